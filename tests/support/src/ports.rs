//! Free loopback ports for servers started by tests.

use std::net::TcpListener;

/// A port that was free a moment ago. The OS hands out ephemeral ports in sequence, so the window
/// in which another test could take it is tiny; servers that can bind port 0 themselves should.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("cannot bind an ephemeral loopback port")
}

/// `n` distinct free ports, all held until all are chosen so none repeats.
pub fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("cannot bind an ephemeral loopback port"))
        .collect();
    listeners.iter().map(|l| l.local_addr().expect("bound listener has an address").port()).collect()
}
