# llm_route: stage 1 of two-stage LLM routing on BIG-IP, driven by a data group.
#
# UNTESTED ON A REAL BIG-IP. No BIG-IP runs where this project is built and tested; this iRule was
# written from F5's iRule reference (JSON:: commands of TMOS 21, class, HTTP::collect,
# HTTP::payload). What is tested: tests/proxy_irule.rs runs this file under the real Tcl interpreter
# with a small double of those BIG-IP commands (following F5's documented behaviour) and checks that
# it reaches the same decision as the proxy on many bodies; that covers the Tcl, the record format
# and the walk, not BIG-IP itself. Test it on a lab BIG-IP before production.
#
# What it does: walks the data group written by
#     llm-load-controller proxy export-bigip --config config/proxy.yaml > llm_routes.conf
# step by step on the JSON request body (or a header), then selects the BIG-IP pool the table ends
# in, or answers the table's rejection. Stage 2 (which member) is the pool's own load-balancing
# mode: use `ratio-least-connections-member` and let the controller's f5 sink set member ratios.
#
# Needs: TMOS 21 or later (JSON:: commands), an HTTP profile on the virtual server. Attach to the
# virtual server serving /v1/chat/completions and /v1/completions. Data group name below.
#
# Assumed command forms (check them against your TMOS version's reference):
#   JSON::parse STRING              -> JSON cache
#   JSON::root CACHE                -> root element
#   JSON::type ELEMENT              -> null|boolean|integer|literal|string|object|array|invalid
#   JSON::get ELEMENT ?TYPE?        -> the element's value (an object or array handle for containers)
#   JSON::object keys OBJECT        -> list of keys
#   JSON::object get OBJECT KEY     -> element of KEY
#   JSON::array size ARRAY / JSON::array get ARRAY INDEX -> element
#
# Differences from the proxy (the proxy is the reference):
#   - comparisons are on text (`equals true` matches true and "true" alike);
#   - `regex` uses Tcl's regexp syntax, not Rust's regex crate: keep patterns to the common subset;
#   - `model_split` picks at random (rand()), so percentages hold on average, not exactly per 100;
#   - criticality and admission are not implemented here (use BIG-IP's own connection limits).

when RULE_INIT {
    set static::llm_dg "/Common/llm_routes"
    set static::llm_max_body 4194304
    # The table is acyclic (the exporter validates it); this bound only guards against a hand-edited
    # data group with a loop.
    set static::llm_max_hops 256
}

proc llm_respond { status code message } {
    set body "{\"error\":{\"message\":\"[string map {\\ \\\\ \" \\\"} $message]\",\"type\":\"invalid_request_error\",\"param\":null,\"code\":\"$code\"}}"
    HTTP::respond $status content $body "Content-Type" "application/json"
}

# Parse a record `k=v&k=v` into a flat key/value list for `array set` (iRules' Tcl has no `dict`);
# values stay percent-encoded.
proc llm_fields { rec } {
    set out [list]
    foreach kv [split $rec "&"] {
        set i [string first "=" $kv]
        if { $i > 0 } {
            lappend out [string range $kv 0 [expr {$i - 1}]] [string range $kv [expr {$i + 1}] end]
        }
    }
    return $out
}

# Follow a dot path from the root: returns {present value}.
proc llm_lookup { root path } {
    set cur $root
    foreach seg [split $path "."] {
        set t [JSON::type $cur]
        if { $t eq "object" } {
            set obj [JSON::get $cur object]
            if { [lsearch -exact [JSON::object keys $obj] $seg] < 0 } { return [list 0 ""] }
            set cur [JSON::object get $obj $seg]
        } elseif { $t eq "array" } {
            if { ![string is integer -strict $seg] } { return [list 0 ""] }
            set arr [JSON::get $cur array]
            set n [JSON::array size $arr]
            if { $seg < 0 } { set seg [expr {$n + $seg}] }
            if { $seg < 0 || $seg >= $n } { return [list 0 ""] }
            set cur [JSON::array get $arr $seg]
        } else {
            return [list 0 ""]
        }
    }
    switch -- [JSON::type $cur] {
        "null"   { return [list 1 "null"] }
        "object" { return [list 1 "\{object\}"] }
        "array"  { return [list 1 "\[array\]"] }
        "invalid" { return [list 0 ""] }
        default  { return [list 1 [JSON::get $cur]] }
    }
}

proc llm_eq { a b } {
    if { [string is double -strict $a] && [string is double -strict $b] } {
        return [expr {$a == $b}]
    }
    return [string equal $a $b]
}

proc llm_test { val op raw } {
    switch -- $op {
        "exists"       { return 1 }
        "equals"       { return [call llm_eq $val [URI::decode $raw]] }
        "not-equals"   { return [expr {![call llm_eq $val [URI::decode $raw]]}] }
        "one-of" {
            foreach v [split $raw ","] {
                if { [call llm_eq $val [URI::decode $v]] } { return 1 }
            }
            return 0
        }
        "prefix" {
            set p [URI::decode $raw]
            return [string equal -length [string length $p] $p $val]
        }
        "regex"        { return [regexp -- [URI::decode $raw] $val] }
        "less-than"    {
            set x [URI::decode $raw]
            if { [string is double -strict $val] } { return [expr {$val < $x}] }
            return 0
        }
        "greater-than" {
            set x [URI::decode $raw]
            if { [string is double -strict $val] } { return [expr {$val > $x}] }
            return 0
        }
    }
    return 0
}

# Pick a model from `m1*90,m2*10` at random, by percentage.
proc llm_split { spec } {
    set r [expr {int(rand() * 100)}]
    set acc 0
    set last ""
    foreach part [split $spec ","] {
        set i [string last "*" $part]
        set name [URI::decode [string range $part 0 [expr {$i - 1}]]]
        incr acc [string range $part [expr {$i + 1}] end]
        set last $name
        if { $r < $acc } { return $name }
    }
    return $last
}

when HTTP_REQUEST {
    set llm_route ""
    if { [HTTP::method] ne "POST" } { return }
    if { ![HTTP::header exists "Content-Length"] } {
        call llm_respond 411 "length_required" "send the JSON body with a Content-Length"
        return
    }
    set len [HTTP::header "Content-Length"]
    if { ![string is integer -strict $len] || $len > $static::llm_max_body } {
        call llm_respond 413 "body_too_large" "request body is larger than $static::llm_max_body bytes"
        return
    }
    if { $len > 0 } { HTTP::collect $len }
}

when HTTP_REQUEST_DATA {
    if { [catch { set cache [JSON::parse [HTTP::payload]] }] } {
        call llm_respond 400 "invalid_json" "request body is not valid JSON"
        return
    }
    set root [JSON::root $cache]
    set step [URI::decode [class match -value "__start" equals $static::llm_dg]]
    set route ""
    for { set hop 0 } { $hop < $static::llm_max_hops } { incr hop } {
        set rec [class match -value $step equals $static::llm_dg]
        if { $rec eq "" } {
            log local0.error "llm_route: data group $static::llm_dg has no step $step"
            call llm_respond 500 "route_table" "routing table has no step $step"
            return
        }
        if { [info exists f] } { unset f }
        array set f [call llm_fields $rec]
        if { ![info exists f(src)] || ![info exists f(op)] || ![info exists f(match)] || ![info exists f(miss)] } {
            call llm_respond 500 "route_table" "routing table record $step is incomplete"
            return
        }
        if { $f(src) eq "header" } {
            set hn [URI::decode $f(name)]
            if { [HTTP::header exists $hn] } {
                set el [list 1 [HTTP::header value $hn]]
            } else {
                set el [list 0 ""]
            }
        } else {
            set el [call llm_lookup $root [URI::decode $f(path)]]
        }
        set raw ""
        if { [info exists f(value)] } { set raw $f(value) }
        # A missing element takes the miss branch, whatever the comparison (as in the proxy).
        set matched 0
        if { [lindex $el 0] } { set matched [call llm_test [lindex $el 1] $f(op) $raw] }
        if { $matched } { set branch "match" } else { set branch "miss" }
        if { $route ne "" } { append route "," }
        append route "$step:$branch"
        set target $f($branch)
        switch -glob -- $target {
            "step:*" {
                set step [URI::decode [string range $target 5 end]]
            }
            "pool:*" {
                if { [info exists f(${branch}_split)] } {
                    set model [call llm_split $f(${branch}_split)]
                    set payload [HTTP::payload]
                    if { [regsub {"model"\s*:\s*"(?:[^"\\]|\\.)*"} $payload "\"model\":\"$model\"" newpayload] } {
                        HTTP::payload replace 0 [HTTP::payload length] $newpayload
                    }
                }
                HTTP::header replace "x-llmlc-route" $route
                pool [URI::decode [string range $target 5 end]]
                HTTP::release
                return
            }
            "reject:*" {
                set rest [string range $target 7 end]
                set i [string first ":" $rest]
                set status [string range $rest 0 [expr {$i - 1}]]
                call llm_respond $status "rejected_by_route" [URI::decode [string range $rest [expr {$i + 1}] end]]
                return
            }
            default {
                call llm_respond 500 "route_table" "step $step has a bad target"
                return
            }
        }
    }
    call llm_respond 500 "route_table" "routing table did not end within $static::llm_max_hops steps"
}
