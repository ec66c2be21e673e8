# llm-load-controller endpoint picker for BIG-IP: one sideband call per request.
#
# Per request this iRule sends the pool's active members and the first bytes of the request body
# to the controller's picker (`picker: {http: ADDR}` on the controller's pool), which answers the
# member where the request's prompt is cached or its first token comes soonest:
#     POST /pick/NAME HTTP/1.0, header x-llmlc-members: ip:port,..., body: the first bytes
#     -> 200 "ip:port" or 200 "fallback"
# and selects `pool POOL member IP PORT`. On a timeout, an error or `fallback`, it does nothing:
# the pool's own load balancing decides, weighted by the ratios the controller pushes (ratio
# mode), so the picker is never in the way of traffic.
#
# The cost: a new TCP connection to the picker per request (BIG-IP's sideband `connect` keeps
# none across requests), plus the wait for the answer, bounded by llmlc_picker_timeout_ms (20 ms
# by default; the picker answers in well under 1 ms on its own host, so the budget is the network).
# Requests also wait for their first llmlc_picker_body_bytes of body (HTTP::collect). Where that
# is too much, the pushed ratios alone (ratio-member mode, or sideband.tcl) cost nothing per request.
#
# Written from F5's iRule reference (HTTP::collect, HTTP::payload, HTTP::release, connect, send,
# recv, close, active_members, LB::server, pool ... member) for TMOS 11.6+ (Tcl 8.4). Tested by
# tests/bigip_picker.rs under the real Tcl interpreter against a double of those commands, calling
# a running controller over real sockets (timeouts included). Untested on a real BIG-IP: try it
# on a lab unit first. Attach it after the routing iRule (llm_route.tcl, priority 500).

when RULE_INIT {
    # The controller's picker door: a virtual server in front of it, or ADDRESS:PORT.
    set static::llmlc_picker "/Common/llmlc_picker_vs"
    # BIG-IP pool, then the controller's pool name, for every pool the picker places.
    set static::llmlc_picker_pools [list /Common/llm_pool llama-8b]
    # The most a request waits for the picker (connect, send and answer each).
    set static::llmlc_picker_timeout_ms 20
    # How much of the body the picker sees (the prompt's opening is what a prefix cache shares).
    set static::llmlc_picker_body_bytes 16384
    # A client's session or prefix key, passed on when present.
    set static::llmlc_picker_key_header "x-llm-prefix-key"
}

# Ask the picker for `name` (the controller's pool) among the active members of `bigip_pool`
# with `body`; select the member it answers. Returns the member picked, or "" (the pool decides).
proc llmlc_picker_ask { bigip_pool name body key } {
    set members {}
    set listed {}
    foreach m [active_members -list $bigip_pool] {
        set addr [lindex $m 0]
        # Route domains (10.0.0.1%2) are BIG-IP's own: the controller knows the bare address.
        set pct [string first "%" $addr]
        if { $pct >= 0 } { set addr [string range $addr 0 [expr {$pct - 1}]] }
        if { [string first ":" $addr] >= 0 } { set id "\[$addr\]:[lindex $m 1]" } else { set id "$addr:[lindex $m 1]" }
        lappend members $id
        set listed_by($id) $m
    }
    if { [llength $members] == 0 } { return "" }
    set conn [connect -timeout $static::llmlc_picker_timeout_ms -idle 2 -status cstat $static::llmlc_picker]
    if { $conn eq "" } { return "" }
    set req "POST /pick/$name HTTP/1.0\r\nHost: llm-load-controller\r\nContent-Type: application/octet-stream\r\nContent-Length: [string length $body]\r\nx-llmlc-members: [join $members ,]\r\n"
    if { $key ne "" } { append req "x-llm-prefix-key: $key\r\n" }
    append req "\r\n$body"
    send -timeout $static::llmlc_picker_timeout_ms -status sstat $conn $req
    set data ""
    recv -timeout $static::llmlc_picker_timeout_ms -status rstat 4096 $conn data
    close $conn
    if { ![string match "HTTP/1.? 200*" $data] } { return "" }
    set at [string first "\r\n\r\n" $data]
    if { $at < 0 } { return "" }
    set answer [string trim [string range $data [expr {$at + 4}] end]]
    # Only a member of the list sent is ever selected.
    if { ![info exists listed_by($answer)] } { return "" }
    set m $listed_by($answer)
    pool $bigip_pool member [lindex $m 0] [lindex $m 1]
    return $m
}

when HTTP_REQUEST priority 650 {
    set llmlc_picker_pool [LB::server pool]
    set llmlc_picker_name ""
    foreach {p n} $static::llmlc_picker_pools {
        if { $p eq $llmlc_picker_pool } { set llmlc_picker_name $n; break }
    }
    if { $llmlc_picker_name eq "" } { return }
    set llmlc_picker_key [HTTP::header value $static::llmlc_picker_key_header]
    set len [HTTP::header value Content-Length]
    if { [string is integer -strict $len] && $len > 0 } {
        if { $len > $static::llmlc_picker_body_bytes } { set len $static::llmlc_picker_body_bytes }
        # The answer comes in HTTP_REQUEST_DATA, once the body's first bytes are here.
        HTTP::collect $len
    } else {
        call llmlc_picker_ask $llmlc_picker_pool $llmlc_picker_name "" $llmlc_picker_key
    }
}

when HTTP_REQUEST_DATA {
    if { [info exists llmlc_picker_name] && $llmlc_picker_name ne "" } {
        call llmlc_picker_ask $llmlc_picker_pool $llmlc_picker_name [HTTP::payload] $llmlc_picker_key
    }
    HTTP::release
}
