//! Free loopback ports for servers started by tests.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::sync::Mutex;

/// Ports this process already handed out. A port is released as soon as it is chosen (the server
/// that will use it binds it later), and Linux may give the same ephemeral port to the very next
/// `bind(0)`: two placeholders of one HAProxy template once got the same port that way.
static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// A port that was free a moment ago and that this process has not handed out before. Across
/// processes the window in which another test could take it is tiny; servers that can bind port 0
/// themselves should.
pub fn free_port() -> u16 {
    let mut seen = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..1000 {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("cannot bind an ephemeral loopback port");
        if seen.insert(port) {
            return port;
        }
    }
    panic!("no fresh ephemeral loopback port in 1000 tries");
}

/// A loopback address that refuses every connection for as long as this lives: its port is bound
/// but never listened on, so neither this process nor another can start a server there (a port
/// merely found free once was, in a test whose "dead" member then answered).
pub struct Refused {
    _socket: tokio::net::TcpSocket,
    pub addr: std::net::SocketAddr,
}

/// A fresh [`Refused`] address.
pub fn refused() -> Refused {
    let socket = tokio::net::TcpSocket::new_v4().expect("cannot create a TCP socket");
    socket.bind(([127, 0, 0, 1], 0).into()).expect("cannot bind an ephemeral loopback port");
    let addr = socket.local_addr().expect("a bound socket has an address");
    Refused { _socket: socket, addr }
}

/// `n` distinct free ports, none handed out before by this process.
pub fn free_ports(n: usize) -> Vec<u16> {
    (0..n).map(|_| free_port()).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn ports_never_repeat_within_a_process() {
        let ports = super::free_ports(200);
        let distinct: std::collections::HashSet<_> = ports.iter().collect();
        assert_eq!(distinct.len(), ports.len());
    }

    #[test]
    fn a_refused_address_refuses_while_it_is_held() {
        let r = super::refused();
        let e = std::net::TcpStream::connect(r.addr).expect_err("nothing listens there");
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
        assert!(std::net::TcpListener::bind(r.addr).is_err(), "and nobody else can take the port");
    }
}
