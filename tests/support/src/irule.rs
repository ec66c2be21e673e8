//! BIG-IP iRules under the real Tcl interpreter (`tclsh`, Debian package `tcl`): no BIG-IP runs
//! here, so [`DOUBLE`] defines the BIG-IP commands the shipped iRules use, written from F5's
//! iRule reference: `table` (subtables, lifetimes on a clock the test moves), `connect`/`send`/
//! `recv`/`close` over real TCP sockets (`recv` honours `-timeout`), `active_members`,
//! `LB::server pool`, `pool ... member`, `HTTP::header value`, `HTTP::collect`/`payload`/`release`.
//! Connections are namespaces, so variables live per connection as in a real iRule; `fire CONN
//! EVENT` runs a `when` block.

use std::path::Path;
use std::process::Command;

pub const DOUBLE: &str = r#"
namespace eval static {}
rename close tcl_close
set ::now 0
set ::connects 0
set ::logs {}
proc when { event args } { set ::handlers($event) [lindex $args end] }
proc call { name args } { uplevel 1 [list $name {*}$args] }
proc log { args } { lappend ::logs [lindex $args end] }
# Each client connection is a namespace: iRule variables are per connection.
proc fire { conn event } {
    # RULE_INIT runs once for the rule, outside any connection.
    if { $event eq "RULE_INIT" } { namespace eval :: $::handlers($event); return }
    namespace eval ::conn$conn $::handlers($event)
}

# Options first, then positional arguments; returns {options positional}.
proc split_opts { argv } {
    set opts {}
    set pos {}
    set i 0
    while { $i < [llength $argv] } {
        set a [lindex $argv $i]
        if { [lsearch -exact {-timeout -idle -status -protocol -subtable} $a] >= 0 } {
            lappend opts $a [lindex $argv [incr i]]
        } elseif { [lsearch -exact {-notouch -mustexist -peek -eol} $a] >= 0 } {
            lappend opts $a 1
        } else {
            set pos [lrange $argv $i end]
            break
        }
        incr i
    }
    return [list $opts $pos]
}
proc opt { opts name default } {
    foreach {k v} $opts { if { $k eq $name } { return $v } }
    return $default
}

# table: values with an absolute lifetime on ::now (timeouts are `indefinite` in the iRule).
proc table { sub args } {
    lassign [split_opts $args] opts pos
    set st [opt $opts -subtable ""]
    set key [lindex $pos 0]
    set id "$st\x00$key"
    if { [info exists ::tbl_exp($id)] && $::tbl_exp($id) ne "" && $::now >= $::tbl_exp($id) } {
        unset ::tbl($id) ::tbl_exp($id)
    }
    switch -- $sub {
        lookup { if { [info exists ::tbl($id)] } { return $::tbl($id) }; return "" }
        add - set {
            if { $sub eq "add" && [info exists ::tbl($id)] } { return $::tbl($id) }
            set ::tbl($id) [lindex $pos 1]
            set life [lindex $pos 3]
            set ::tbl_exp($id) [expr { $life eq "" || $life eq "indefinite" ? "" : $::now + $life }]
            return $::tbl($id)
        }
        incr {
            set delta [expr { [llength $pos] > 1 ? [lindex $pos 1] : 1 }]
            if { ![info exists ::tbl($id)] } { set ::tbl($id) 0; set ::tbl_exp($id) "" }
            set ::tbl($id) [expr { $::tbl($id) + $delta }]
            return $::tbl($id)
        }
    }
    error "double: unsupported table $sub"
}

# Sideband over real sockets.
proc connect { args } {
    lassign [split_opts $args] opts pos
    upvar 1 [opt $opts -status cs_unused] st
    incr ::connects
    set dest [lindex $pos 0]
    set i [string last : $dest]
    if { [catch { socket [string range $dest 0 [expr {$i - 1}]] [string range $dest [expr {$i + 1}] end] } s] } {
        set st failed
        return ""
    }
    fconfigure $s -translation binary -buffering none
    set st connected
    return $s
}
proc send { args } {
    lassign [split_opts $args] opts pos
    upvar 1 [opt $opts -status ss_unused] st
    puts -nonewline [lindex $pos 0] [lindex $pos 1]
    flush [lindex $pos 0]
    set st sent
    return [string length [lindex $pos 1]]
}
# recv: up to `max` bytes, until the peer closes or -timeout (ms) passes; what arrived is kept.
proc recv { args } {
    lassign [split_opts $args] opts pos
    upvar 1 [opt $opts -status rs_unused] st
    upvar 1 [lindex $pos 2] out
    lassign $pos max chan
    set timeout [opt $opts -timeout 0]
    set deadline [expr { [clock milliseconds] + $timeout }]
    set out ""
    fconfigure $chan -blocking 0
    while { 1 } {
        append out [read $chan [expr { $max - [string length $out] }]]
        if { [eof $chan] || [string length $out] >= $max } { set st closed; break }
        if { $timeout > 0 && [clock milliseconds] >= $deadline } { set st timeout; break }
        after 1
    }
    return [string length $out]
}
proc close { conn } { tcl_close $conn }

namespace eval LB { proc server { what } { return $::cur_pool } }
proc active_members { flag pool } { return $::active($pool) }
proc pool { name args } { set ::picked [list $name {*}$args] }
# BIG-IP's crc32 (the zlib one); HTTP::header value answers "" for a header the request lacks.
proc crc32 { s } { return [zlib crc32 [encoding convertto utf-8 $s]] }
set ::hdr {}
# HTTP::collect N asks for N bytes of body; the driver then fires HTTP_REQUEST_DATA with ::payload
# (the double hands over the first N bytes); HTTP::release is counted.
set ::payload ""
set ::collect 0
set ::released 0
namespace eval HTTP {
    proc header { sub name } {
        if { $sub ne "value" } { error "double: unsupported HTTP::header $sub" }
        if { [dict exists $::hdr [string tolower $name]] } { return [dict get $::hdr [string tolower $name]] }
        return ""
    }
    proc collect { n } { set ::collect $n }
    proc payload { } { return [string range $::payload 0 [expr { $::collect - 1 }]] }
    proc release { } { incr ::released }
}
"#;

/// Run [`DOUBLE`], the iRule at `irule`, its `RULE_INIT` and then `driver` in tclsh; its stdout.
/// Panics (with tclsh's stderr) when the script fails.
pub fn tclsh(irule: &Path, driver: &str) -> String {
    let rule = std::fs::read_to_string(irule).unwrap_or_else(|e| panic!("read {}: {e}", irule.display()));
    let script = format!("{DOUBLE}\n{rule}\nfire 0 RULE_INIT\n{driver}\n");
    // From a file: tclsh reading stdin carries on after an error and exits 0.
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("irule-test.tcl");
    std::fs::write(&path, script).expect("write script");
    let out = Command::new("tclsh").arg(&path).output().expect("run tclsh (install the tcl package)");
    assert!(out.status.success(), "tclsh failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}
