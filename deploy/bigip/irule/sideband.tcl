# llm-load-controller sideband weighting: BIG-IP pulls the ratios, nothing on BIG-IP is written.
#
# For pools that F5 Container Ingress Services (CIS) or an AS3 declaration own: their reconcile would
# overwrite member ratios the controller writes, so instead this iRule fetches the controller's
# ratios over a sideband connection (GET /v1/ratios/POOL, plain text, one "address port ratio" line
# per member) every few seconds into the session table, and picks the member with the fewest
# requests in flight per unit of ratio: least-connections weighted by the controller's ratios.
# Run the controller with the F5 sink in `mode: sideband` (it reads the pool's members, writes
# nothing) or any sink; only its /v1/ratios/POOL endpoint is used here.
#
# Written from F5's iRule reference (connect/send/recv/close, table, active_members, LB::server,
# pool ... member, HTTP::header, crc32) for TMOS 11.6+ (Tcl 8.4: no lassign, no dict). What is tested:
# tests/bigip_sideband.rs runs this file under the real Tcl interpreter against a double of those
# commands, fetching from a running controller over a real socket. It is untested on a real BIG-IP:
# try it on a lab unit first.
#
# Attach to the virtual server after the routing iRule (llm_route.tcl runs at the default priority
# 500; this one at 600, so it sees the pool stage 1 chose). The pool's own mode (keep
# least-connections-member) decides alone when no ratios are known: before the first fetch, and
# when the controller has been unreachable for longer than llmlc_ttl. Fail-static, then fail-open.
#
# In-flight requests are counted per member in the session table: +1 when this iRule picks a
# member, -1 when the next request on the connection starts, the connection closes, or the pick
# fails (LB_FAILED). Requests routed by the pool itself are not counted.
#
# Prefix-cache affinity (llmlc_affinity_factor > 0): a request with the llmlc_affinity_header
# (a session or prefix id, or the 16 hex digits the reference proxy sets) goes to the member its
# key hashes to, while that member has fewer requests in flight than its bound: factor/100 of the
# pool's requests in flight (this one included) times the member's share of the ratios. Over the
# bound, or without the header, the weighted least-connections pick above decides. The hash is a
# weighted rendezvous hash (each member scores ratio / -ln(u), u from the mixed crc32 of key and
# member; the highest wins): a key keeps its member while the member set stays, a member's share
# of the keys follows its ratio, and a member leaving moves only its own keys. A BIG-IP hash persistence
# profile would keep the key too, but cannot see the controller's ratios or a member's load, so
# the iRule computes the hash itself and needs no persistence profile or records.

when RULE_INIT {
    # Where the controller serves its ratios: a virtual server name (e.g. one in front of the
    # controller's Service, or its route) or ADDRESS:PORT reachable from the BIG-IP.
    set static::llmlc_controller "/Common/llmlc_ratios_vs"
    # BIG-IP pool, then the controller's pool name, for every weighted pool.
    set static::llmlc_pools [list /Common/llm_pool llama-8b]
    # Fetch at most every llmlc_refresh seconds (one fetch per pool for the whole unit: a table key
    # is the lock); keep ratios llmlc_ttl seconds after the last successful fetch.
    set static::llmlc_refresh 5
    set static::llmlc_ttl 60
    # The sideband call runs inside a client's request: keep it short.
    set static::llmlc_timeout_ms 300
    # Prefix-cache affinity: the key's header, and the load bound in percent (0: off).
    set static::llmlc_affinity_header "x-llm-prefix-key"
    set static::llmlc_affinity_factor 150
}

# crc32 is linear: the crc32s of one key with two members differ by the same bits whatever the
# key, so the members' scores would move together and one member would win most keys. Murmur3's
# finaliser (multiplications, mod 2^32) makes them independent. wide(): Tcl 8.4's ints are 32-bit.
proc llmlc_mix { h } {
    set h [expr {wide($h) & 0xFFFFFFFF}]
    set h [expr {$h ^ ($h >> 16)}]
    set h [expr {($h * 0x85EBCA6B) & 0xFFFFFFFF}]
    set h [expr {$h ^ ($h >> 13)}]
    set h [expr {($h * 0xC2B2AE35) & 0xFFFFFFFF}]
    return [expr {$h ^ ($h >> 16)}]
}

# The member `key` hashes to among `members` (each {address port ratio}), or "" if none.
proc llmlc_affinity_pick { key members } {
    set best ""
    set best_score 0
    foreach m $members {
        set h [call llmlc_mix [crc32 "$key [lindex $m 0] [lindex $m 1]"]]
        # u in (0, 1), so that the logarithm is finite.
        set u [expr {($h + 1.0) / 4294967297.0}]
        set score [expr {[lindex $m 2] / -log($u)}]
        if { $best eq "" || $score > $best_score } {
            set best "[lindex $m 0] [lindex $m 1]"
            set best_score $score
        }
    }
    return $best
}

# Fetch one pool's ratios into the subtable llmlc_ratio:NAME. Returns how many were stored.
proc llmlc_fetch { name } {
    set conn [connect -timeout $static::llmlc_timeout_ms -idle 5 -status cstat $static::llmlc_controller]
    if { $conn eq "" } {
        log local0.warn "llmlc: cannot connect to $static::llmlc_controller ($cstat); keeping the last ratios"
        return 0
    }
    set req "GET /v1/ratios/$name HTTP/1.0\r\nHost: llm-load-controller\r\nAccept: text/plain\r\n\r\n"
    send -timeout $static::llmlc_timeout_ms -status sstat $conn $req
    # HTTP/1.0: the controller closes the connection after the body, which ends the wait.
    set data ""
    recv -timeout $static::llmlc_timeout_ms -status rstat 262144 $conn data
    close $conn
    if { ![string match "HTTP/1.? 200*" $data] } {
        log local0.warn "llmlc: no ratios for $name from the controller ([string range $data 0 40]); keeping the last ones"
        return 0
    }
    set at [string first "\r\n\r\n" $data]
    if { $at < 0 } { return 0 }
    set stored 0
    foreach line [split [string range $data [expr {$at + 4}] end] "\n"] {
        set line [string trim $line]
        if { $line eq "" || [string index $line 0] eq "#" } { continue }
        set f [split $line " "]
        if { [llength $f] != 3 } { continue }
        set ratio [lindex $f 2]
        if { ![string is integer -strict $ratio] || $ratio < 1 } { continue }
        table set -subtable "llmlc_ratio:$name" "[lindex $f 0] [lindex $f 1]" $ratio indefinite $static::llmlc_ttl
        incr stored
    }
    return $stored
}

# The request this connection had in flight (if any) is over.
proc llmlc_release {} {
    upvar 1 llmlc_pick pick
    if { [info exists pick] } {
        table incr -notouch -subtable [lindex $pick 0] [lindex $pick 1] -1
        unset pick
    }
}

when HTTP_REQUEST priority 600 {
    call llmlc_release
    set llmlc_bigip_pool [LB::server pool]
    set llmlc_name ""
    foreach {p n} $static::llmlc_pools {
        if { $p eq $llmlc_bigip_pool } { set llmlc_name $n; break }
    }
    if { $llmlc_name eq "" } { return }

    # One fetch per pool per refresh period: the first request to add the key does it.
    set llmlc_me "[clock clicks]"
    if { [table add -subtable llmlc_fetch $llmlc_name $llmlc_me indefinite $static::llmlc_refresh] eq $llmlc_me } {
        call llmlc_fetch $llmlc_name
    }

    set llmlc_best ""
    set llmlc_best_score 0
    set llmlc_known {}
    set llmlc_ratio_sum 0
    set llmlc_inflight_sum 0
    foreach m [active_members -list $llmlc_bigip_pool] {
        set key "[lindex $m 0] [lindex $m 1]"
        set r [table lookup -notouch -subtable "llmlc_ratio:$llmlc_name" $key]
        if { $r eq "" } { continue }
        set n [table lookup -notouch -subtable "llmlc_inflight:$llmlc_bigip_pool" $key]
        if { $n eq "" || $n < 0 } { set n 0 }
        lappend llmlc_known [list [lindex $m 0] [lindex $m 1] $r]
        set llmlc_inflight($key) $n
        incr llmlc_ratio_sum $r
        incr llmlc_inflight_sum $n
        set score [expr {($n + 1.0) / $r}]
        if { $llmlc_best eq "" || $score < $llmlc_best_score } {
            set llmlc_best $key
            set llmlc_best_score $score
        }
    }
    # No ratio known for any active member: the pool's own mode decides.
    if { $llmlc_best eq "" } { return }

    set llmlc_key [HTTP::header value $static::llmlc_affinity_header]
    if { $static::llmlc_affinity_factor > 0 && $llmlc_key ne "" } {
        set llmlc_home [call llmlc_affinity_pick $llmlc_key $llmlc_known]
        set llmlc_r [table lookup -notouch -subtable "llmlc_ratio:$llmlc_name" $llmlc_home]
        set llmlc_bound [expr {ceil($static::llmlc_affinity_factor / 100.0 * ($llmlc_inflight_sum + 1) * $llmlc_r / $llmlc_ratio_sum)}]
        if { $llmlc_inflight($llmlc_home) < $llmlc_bound } { set llmlc_best $llmlc_home }
    }
    unset -nocomplain llmlc_inflight
    pool $llmlc_bigip_pool member [lindex $llmlc_best 0] [lindex $llmlc_best 1]
    set llmlc_pick [list "llmlc_inflight:$llmlc_bigip_pool" $llmlc_best]
    table incr -notouch -subtable "llmlc_inflight:$llmlc_bigip_pool" $llmlc_best
}

when LB_FAILED {
    call llmlc_release
}

when CLIENT_CLOSED {
    call llmlc_release
}
