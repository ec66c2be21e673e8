//! Stage 1: the routing table. A list of steps, each looking at one element of the request (a path
//! into the JSON body, or a header), comparing it, and going to another step, a pool, or a rejection
//! on match and on miss — the same shape as a BIG-IP data group walked by an iRule, so one table
//! drives both (see [`super::bigip`]). A step can also be a guard ([`super::guard`]): deny rules
//! and an external guard service decide allow (go on at `match`), block, or route elsewhere.
//!
//! [`RouteTable::compile`] validates once at load (unknown step ids, cycles, unreachable steps,
//! targets that go nowhere, bad regexes, empty path segments) and reports every problem naming the
//! step. [`RouteTable::evaluate`] is pure, bounded (it visits each step at most once, the table being
//! acyclic) and never panics on any JSON: it only reads the body.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use axum::http::HeaderMap;
use regex::Regex;
use serde::Deserialize;
use serde_json::Value;

use super::guard::{Guard, GuardConfig, Outcome, Verdict};

/// Most steps a table may have: keeps evaluation cost and BIG-IP data-group size bounded.
pub const MAX_STEPS: usize = 256;

// ---------------------------------------------------------------- config shapes

/// The `routes:` section as written in YAML.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutesConfig {
    /// First step; default: the first one listed.
    #[serde(default)]
    pub start: Option<String>,
    pub steps: Vec<StepConfig>,
}

/// One step: look at `field` (a dot path into the body) or `header`, compare with `op`/`value`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepConfig {
    pub id: String,
    /// Path into the JSON body: `model`, `metadata.interactive`, `messages.0.role`, `messages.-1.role`
    /// (negative indexes count from the end of an array).
    #[serde(default)]
    pub field: Option<String>,
    /// A request header name instead of a body field.
    #[serde(default)]
    pub header: Option<String>,
    /// Required for a comparison step; a guard step has none.
    #[serde(default)]
    pub op: Option<Op>,
    /// What to compare with: a string, number or boolean; a list for `one-of`; omitted for `exists`.
    #[serde(default)]
    pub value: Option<Value>,
    /// A guard step instead of a comparison: `match` is where allowed requests go; there is no
    /// `miss` (a blocked request is answered with the guard's status).
    #[serde(default)]
    pub guard: Option<GuardConfig>,
    #[serde(rename = "match")]
    pub on_match: TargetConfig,
    #[serde(rename = "miss", default)]
    pub on_miss: TargetConfig,
}

/// The comparisons a step can make.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Op {
    Equals,
    NotEquals,
    OneOf,
    Prefix,
    Exists,
    Regex,
    LessThan,
    GreaterThan,
}

impl Op {
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Equals => "equals",
            Op::NotEquals => "not-equals",
            Op::OneOf => "one-of",
            Op::Prefix => "prefix",
            Op::Exists => "exists",
            Op::Regex => "regex",
            Op::LessThan => "less-than",
            Op::GreaterThan => "greater-than",
        }
    }
}

/// Where a branch goes: exactly one of `step`, `pool`, `reject`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetConfig {
    #[serde(default)]
    pub step: Option<String>,
    #[serde(default)]
    pub pool: Option<String>,
    /// Canary across model (LoRA adapter) versions: the body's `model` is rewritten to one of these
    /// names, in these percentages (must add up to 100). Only with `pool`.
    #[serde(default)]
    pub model_split: Option<BTreeMap<String, u32>>,
    /// Answer with this HTTP status (400..=599) instead of forwarding.
    #[serde(default)]
    pub reject: Option<u16>,
    /// Message of the rejection (OpenAI-style error body).
    #[serde(default)]
    pub message: Option<String>,
}

impl TargetConfig {
    fn is_set(&self) -> bool {
        self.step.is_some()
            || self.pool.is_some()
            || self.reject.is_some()
            || self.model_split.is_some()
            || self.message.is_some()
    }
}

// ---------------------------------------------------------------- compiled table

/// One segment of a body path.
#[derive(Debug, Clone, PartialEq)]
pub enum Seg {
    /// An object key; also tried as an array index when it parses as one.
    Key(String),
}

/// What a step looks at.
#[derive(Debug, Clone)]
pub enum Source {
    Field {
        path: String,
        segs: Vec<Seg>,
    },
    Header(String),
    /// A guard step: the whole request, judged by [`Step::guard`].
    Guard,
}

impl Source {
    pub fn describe(&self) -> String {
        match self {
            Source::Field { path, .. } => path.clone(),
            Source::Header(h) => format!("header {h}"),
            Source::Guard => "guard".into(),
        }
    }
}

/// A comparison ready to run.
#[derive(Debug, Clone)]
pub enum Cond {
    Equals(Value),
    NotEquals(Value),
    OneOf(Vec<Value>),
    Prefix(String),
    Exists,
    Regex(Regex),
    LessThan(f64),
    GreaterThan(f64),
}

/// Where a branch goes, with step ids resolved to indexes.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    Step(usize),
    Pool { pool: String, split: Option<usize> },
    Reject { status: u16, message: String },
}

/// A model split: names and percentages, in a stable order.
#[derive(Debug, Clone, PartialEq)]
pub struct Split {
    /// Where it is used, for messages: `STEP.match` or `STEP.miss`.
    pub at: String,
    pub models: Vec<(String, u32)>,
}

#[derive(Debug, Clone)]
pub struct Step {
    pub id: String,
    pub source: Source,
    pub op: Op,
    pub cond: Cond,
    /// The configured value, for explanations and export.
    pub value: Option<Value>,
    pub on_match: Target,
    pub on_miss: Target,
    /// Set for a guard step (then `source` is [`Source::Guard`] and `on_miss` stands for a block).
    pub guard: Option<Box<Guard>>,
}

impl Step {
    /// A human description of a guard step's checks.
    pub fn describe_guard(&self) -> Option<String> {
        let g = self.guard.as_ref()?;
        let mut parts = Vec::new();
        if !g.deny.is_empty() {
            parts.push(format!("{} deny rule(s)", g.deny.len()));
        }
        if let Some(u) = &g.url {
            let on_error = if g.on_error == super::guard::OnError::Allow { "allow" } else { "block" };
            parts.push(format!("service {u} (timeout {:?}, on error {on_error})", g.timeout));
        }
        Some(parts.join(", then "))
    }
}

/// A validated routing table.
#[derive(Debug, Clone)]
pub struct RouteTable {
    pub steps: Vec<Step>,
    pub start: usize,
    pub splits: Vec<Split>,
}

/// One step taken during evaluation.
#[derive(Debug, Clone, PartialEq)]
pub struct Hop {
    pub step: usize,
    /// What the element held (`None` when it is missing), rendered as JSON.
    pub seen: Option<String>,
    pub matched: bool,
    /// For a guard step: its outcome (`allow`, `block`, `route`, `deny-rule`, `error-allow`,
    /// `error-block`), shown in the route instead of match/miss.
    pub outcome: Option<&'static str>,
}

/// The outcome of evaluating a table on one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub hops: Vec<Hop>,
    pub target: Target,
    /// The error code of a rejection by a guard (`blocked_by_guard`, `guard_unavailable`).
    pub code: Option<&'static str>,
}

/// Where a walk through the table stopped: at a decision, or at a guard step that needs asking.
#[derive(Debug, Clone, PartialEq)]
pub enum Walk {
    Done(Decision),
    Guard { hops: Vec<Hop>, step: usize },
}

impl Decision {
    /// `STEP:match,STEP:miss,...`: the route taken, for the response header.
    pub fn route(&self, table: &RouteTable) -> String {
        let mut s = String::new();
        for (i, h) in self.hops.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            s.push_str(&table.steps[h.step].id);
            s.push(':');
            s.push_str(h.outcome.unwrap_or(if h.matched { "match" } else { "miss" }));
        }
        s
    }
}

impl RouteTable {
    /// Validate and compile. `pools` are the pool names that exist. Errors are `(field path, message)`
    /// pairs, one per problem, each naming the step.
    pub fn compile(cfg: &RoutesConfig, pools: &[String]) -> Result<RouteTable, Vec<(String, String)>> {
        let mut errs: Vec<(String, String)> = Vec::new();
        if cfg.steps.is_empty() {
            errs.push(("routes.steps".into(), "needs at least one step".into()));
            return Err(errs);
        }
        if cfg.steps.len() > MAX_STEPS {
            errs.push((
                "routes.steps".into(),
                format!(
                    "{} steps is more than the limit of {MAX_STEPS}; merge steps with one-of",
                    cfg.steps.len()
                ),
            ));
        }
        let mut index: HashMap<&str, usize> = HashMap::new();
        for (i, s) in cfg.steps.iter().enumerate() {
            let at = format!("routes.steps[{i}]");
            // Ids travel in a response header, metric labels and BIG-IP record names: keep them plain.
            if s.id.is_empty()
                || !s.id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
            {
                errs.push((
                    format!("{at}.id"),
                    format!("step id {:?} must be non-empty letters, digits, '_', '-' or '.'", s.id),
                ));
            }
            if let Some(prev) = index.insert(s.id.as_str(), i) {
                errs.push((
                    format!("{at}.id"),
                    format!("step id {:?} is also used by routes.steps[{prev}]", s.id),
                ));
            }
        }
        let start = match &cfg.start {
            None => 0,
            Some(id) => match index.get(id.as_str()) {
                Some(&i) => i,
                None => {
                    errs.push(("routes.start".into(), format!("no step has id {id:?}")));
                    0
                }
            },
        };

        let mut splits = Vec::new();
        let mut steps = Vec::with_capacity(cfg.steps.len());
        for (i, s) in cfg.steps.iter().enumerate() {
            let at = format!("routes.steps[{i}] (step {:?})", s.id);
            if let Some(g) = &s.guard {
                if s.field.is_some() || s.header.is_some() || s.op.is_some() || s.value.is_some() {
                    errs.push((
                        at.clone(),
                        "a guard step takes no `field`, `header`, `op` or `value`".into(),
                    ));
                }
                if s.on_miss.is_set() {
                    errs.push((
                        format!("{at}.miss"),
                        "a guard step has no `miss`: a blocked request gets the guard's status; `match` is where allowed requests go".into(),
                    ));
                }
                let guard = match Guard::compile(g, &format!("{at}.guard"), &index, pools) {
                    Ok(g) => Some(Box::new(g)),
                    Err(e) => {
                        errs.extend(e);
                        None
                    }
                };
                let on_match = match compile_target(&s.on_match, &index, pools) {
                    Ok((t, None)) => t,
                    Ok((_, Some(_))) => {
                        errs.push((
                            format!("{at}.match"),
                            "a guard step's `match` cannot carry a model_split; point it at a step that does"
                                .into(),
                        ));
                        Target::Reject { status: 500, message: String::new() }
                    }
                    Err(e) => {
                        errs.push((format!("{at}.match"), e));
                        Target::Reject { status: 500, message: String::new() }
                    }
                };
                steps.push(Step {
                    id: s.id.clone(),
                    source: Source::Guard,
                    op: Op::Exists,
                    cond: Cond::Exists,
                    value: None,
                    on_match,
                    on_miss: Target::Reject { status: 403, message: "blocked by the guard".into() },
                    guard,
                });
                continue;
            }
            let op = s.op.unwrap_or_else(|| {
                errs.push((format!("{at}.op"), "missing: give `op` (or make this a `guard` step)".into()));
                Op::Exists
            });
            let source = match (&s.field, &s.header) {
                (Some(f), None) => match parse_path(f) {
                    Ok(segs) => Source::Field { path: f.clone(), segs },
                    Err(e) => {
                        errs.push((format!("{at}.field"), e));
                        Source::Field { path: f.clone(), segs: Vec::new() }
                    }
                },
                (None, Some(h)) => {
                    if axum::http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                        errs.push((format!("{at}.header"), format!("{h:?} is not a valid header name")));
                    }
                    Source::Header(h.to_ascii_lowercase())
                }
                _ => {
                    errs.push((at.clone(), "give exactly one of `field` (a body path) or `header`".into()));
                    Source::Header(String::new())
                }
            };
            let cond = match compile_cond(op, s.value.as_ref()) {
                Ok(c) => c,
                Err(e) => {
                    errs.push((format!("{at}.value"), e));
                    Cond::Exists
                }
            };
            let mut target = |t: &TargetConfig, branch: &str| -> Target {
                match compile_target(t, &index, pools) {
                    Ok((target, split)) => match (target, split) {
                        (Target::Pool { pool, .. }, Some(models)) => {
                            splits.push(Split { at: format!("{}.{branch}", s.id), models });
                            Target::Pool { pool, split: Some(splits.len() - 1) }
                        }
                        (t, _) => t,
                    },
                    Err(e) => {
                        errs.push((format!("{at}.{branch}"), e));
                        Target::Reject { status: 500, message: String::new() }
                    }
                }
            };
            let on_match = target(&s.on_match, "match");
            let on_miss = target(&s.on_miss, "miss");
            steps.push(Step {
                id: s.id.clone(),
                source,
                op,
                cond,
                value: s.value.clone(),
                on_match,
                on_miss,
                guard: None,
            });
        }
        // Cycles and reachability, on the resolved graph (a target that failed to resolve counts as
        // an end, so every problem is reported in one pass).
        if let Some(cycle) = find_cycle(&steps, start) {
            let names: Vec<&str> = cycle.iter().map(|&i| steps[i].id.as_str()).collect();
            errs.push((
                format!("routes.steps[{}] (step {:?})", cycle[0], steps[cycle[0]].id),
                format!(
                    "steps form a cycle: {} -> {}; every path must end in a pool or a reject",
                    names.join(" -> "),
                    names[0]
                ),
            ));
        }
        let reach = reachable(&steps, start);
        for (i, s) in steps.iter().enumerate() {
            if !reach[i] {
                errs.push((
                    format!("routes.steps[{i}] (step {:?})", s.id),
                    format!(
                        "unreachable from the start step {:?}; point a match/miss at it or remove it",
                        steps[start].id
                    ),
                ));
            }
        }
        if errs.is_empty() {
            Ok(RouteTable { steps, start, splits })
        } else {
            Err(errs)
        }
    }

    /// Walk the table from step `from` until a decision or a guard step. Never panics; at most
    /// `steps.len()` hops in all.
    pub fn walk(&self, from: usize, mut hops: Vec<Hop>, body: &Value, headers: &HeaderMap) -> Walk {
        let mut cur = from;
        // The table is acyclic (checked at compile), so this bound is never hit; it is kept as a
        // guarantee that evaluation ends even if that check had a bug.
        while hops.len() <= self.steps.len() {
            let Some(step) = self.steps.get(cur) else { break };
            let element: Option<Value> = match &step.source {
                Source::Guard => return Walk::Guard { hops, step: cur },
                Source::Field { segs, .. } => lookup(body, segs).cloned(),
                Source::Header(h) => headers
                    .get(h.as_str())
                    .map(|v| Value::String(String::from_utf8_lossy(v.as_bytes()).into_owned())),
            };
            let matched = element.as_ref().is_some_and(|v| step.cond.test(v));
            hops.push(Hop { step: cur, seen: element.as_ref().map(render_short), matched, outcome: None });
            let next = if matched { &step.on_match } else { &step.on_miss };
            match next {
                Target::Step(n) => cur = *n,
                t => return Walk::Done(Decision { hops, target: t.clone(), code: None }),
            }
        }
        Walk::Done(Self::unending(hops))
    }

    fn unending(hops: Vec<Hop>) -> Decision {
        Decision {
            hops,
            target: Target::Reject {
                status: 500,
                message: "routing table did not end (a bug; report it)".into(),
            },
            code: None,
        }
    }

    /// Record a guard step's outcome: the hop, and where the request goes next.
    pub fn after_guard(
        &self,
        step: usize,
        mut hops: Vec<Hop>,
        o: &Outcome,
    ) -> Result<Decision, (usize, Vec<Hop>)> {
        let s = &self.steps[step];
        hops.push(Hop {
            step,
            seen: Some(o.note.clone()),
            matched: o.verdict == Verdict::Allow,
            outcome: Some(o.kind),
        });
        let (target, code) = match &o.verdict {
            Verdict::Allow => (s.on_match.clone(), None),
            Verdict::Block { status, message, code } => {
                (Target::Reject { status: *status, message: message.clone() }, Some(*code))
            }
            Verdict::RouteStep(n) => (Target::Step(*n), None),
            Verdict::RoutePool(p) => (Target::Pool { pool: p.clone(), split: None }, None),
        };
        match target {
            Target::Step(n) if hops.len() <= self.steps.len() => Err((n, hops)),
            Target::Step(_) => Ok(Self::unending(hops)),
            target => Ok(Decision { hops, target, code }),
        }
    }

    /// Walk the table for one request, answering guard steps with `guard` (synchronously).
    pub fn evaluate_with(
        &self,
        body: &Value,
        headers: &HeaderMap,
        mut guard: impl FnMut(usize, &Guard) -> Outcome,
    ) -> Decision {
        let (mut cur, mut hops) = (self.start, Vec::new());
        loop {
            match self.walk(cur, hops, body, headers) {
                Walk::Done(d) => return d,
                Walk::Guard { hops: h, step } => {
                    let Some(g) = self.steps[step].guard.as_deref() else { return Self::unending(h) };
                    let o = guard(step, g);
                    match self.after_guard(step, h, &o) {
                        Ok(d) => return d,
                        Err((n, h)) => (cur, hops) = (n, h),
                    }
                }
            }
        }
    }

    /// Walk the table for one request without any network: a guard step applies its deny rules and
    /// otherwise lets the request through, noting that its service was not asked (`explain`, the
    /// BIG-IP comparison).
    pub fn evaluate(&self, body: &Value, headers: &HeaderMap) -> Decision {
        self.evaluate_with(body, headers, |_, g| {
            g.check_rules(body).unwrap_or_else(|| Outcome {
                verdict: Verdict::Allow,
                kind: "allow",
                note: match &g.url {
                    Some(u) => {
                        format!("deny rules passed; service {u} not asked here (it may block or route)")
                    }
                    None => "deny rules passed".into(),
                },
            })
        })
    }

    /// Model names the table compares `model` with (equals, one-of), in table order.
    pub fn model_values(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for s in &self.steps {
            if !s.reads_model() {
                continue;
            }
            let vals: Vec<&Value> = match &s.cond {
                Cond::Equals(v) => vec![v],
                Cond::OneOf(xs) => xs.iter().collect(),
                _ => continue,
            };
            for v in vals.into_iter().filter_map(Value::as_str) {
                if !out.iter().any(|o| o == v) {
                    out.push(v.to_string());
                }
            }
        }
        out
    }

    /// Can a request naming `model` reach a pool that takes it? Steps on `model` are decided by
    /// the name; every other comparison may go either way (some request makes it match, another
    /// miss); guard steps let the request through (their routes are the guard's choice, not the
    /// client's). `takes(pool, split)` says whether a pool takes the name (`split`: the name is a
    /// canary base that the route rewrites). Returns the first such pool.
    pub fn accepts_model(&self, model: &str, takes: impl Fn(&str, bool) -> bool) -> Option<String> {
        let name = Value::String(model.to_string());
        let mut seen = vec![false; self.steps.len()];
        let mut todo: Vec<&Target> = vec![];
        let start = Target::Step(self.start);
        todo.push(&start);
        while let Some(t) = todo.pop() {
            match t {
                Target::Step(i) => {
                    if std::mem::replace(&mut seen[*i], true) {
                        continue;
                    }
                    let s = &self.steps[*i];
                    if s.guard.is_some() {
                        todo.push(&s.on_match);
                    } else if s.reads_model() {
                        todo.push(if s.cond.test(&name) { &s.on_match } else { &s.on_miss });
                    } else {
                        todo.push(&s.on_miss);
                        todo.push(&s.on_match);
                    }
                }
                Target::Pool { pool, split } => {
                    if takes(pool, split.is_some()) {
                        return Some(pool.clone());
                    }
                }
                Target::Reject { .. } => {}
            }
        }
        None
    }

    /// Human explanation of a decision, one line per step, for `proxy explain`.
    pub fn explain(&self, d: &Decision) -> String {
        let mut s = String::new();
        for (k, h) in d.hops.iter().enumerate() {
            let step = &self.steps[h.step];
            if let (Some(kind), Some(what)) = (h.outcome, step.describe_guard()) {
                let next = match d.hops.get(k + 1) {
                    Some(n) => format!("step {}", self.steps[n.step].id),
                    None => self.describe_target(&d.target),
                };
                let _ = writeln!(
                    s,
                    "step {}: guard ({what}) -> {} -> {kind} -> {next}",
                    step.id,
                    h.seen.clone().unwrap_or_default(),
                );
                continue;
            }
            let seen = h.seen.clone().unwrap_or_else(|| "(missing)".into());
            // The configured value in full when short (a one-of list included).
            let value = step.value.as_ref().map(|v| format!(" {}", render_value(v))).unwrap_or_default();
            let next = if h.matched { &step.on_match } else { &step.on_miss };
            let _ = writeln!(
                s,
                "step {}: {} = {} {}{} -> {} -> {}",
                step.id,
                step.source.describe(),
                seen,
                step.op.as_str(),
                value,
                if h.matched { "match" } else { "miss" },
                self.describe_target(next)
            );
        }
        let _ = writeln!(s, "route: {}", d.route(self));
        let _ = writeln!(s, "result: {}", self.describe_target(&d.target));
        s
    }

    pub fn describe_target(&self, t: &Target) -> String {
        match t {
            Target::Step(i) => format!("step {}", self.steps[*i].id),
            Target::Pool { pool, split: None } => format!("pool {pool}"),
            Target::Pool { pool, split: Some(k) } => {
                let models: Vec<String> =
                    self.splits[*k].models.iter().map(|(m, p)| format!("{m} {p}%")).collect();
                format!("pool {pool} (model split: {})", models.join(", "))
            }
            Target::Reject { status, message } => format!("reject {status} ({message})"),
        }
    }
}

impl Cond {
    /// Does `v` (present) satisfy the comparison?
    pub fn test(&self, v: &Value) -> bool {
        match self {
            Cond::Equals(x) => loose_eq(v, x),
            Cond::NotEquals(x) => !loose_eq(v, x),
            Cond::OneOf(xs) => xs.iter().any(|x| loose_eq(v, x)),
            Cond::Prefix(p) => v.as_str().is_some_and(|s| s.starts_with(p.as_str())),
            Cond::Exists => true,
            Cond::Regex(re) => v.as_str().is_some_and(|s| re.is_match(s)),
            Cond::LessThan(x) => as_number(v).is_some_and(|n| n < *x),
            Cond::GreaterThan(x) => as_number(v).is_some_and(|n| n > *x),
        }
    }
}

/// Equality between a request element and a configured value. Same JSON type: plain equality
/// (numbers numerically). A string element against a number or boolean compares the text, so headers
/// (always text) can be compared with `true` or `42`.
fn loose_eq(actual: &Value, expected: &Value) -> bool {
    match (actual, expected) {
        (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
        (Value::String(a), Value::Bool(b)) => a == if *b { "true" } else { "false" },
        (Value::String(a), Value::Number(b)) => a.trim().parse::<f64>().ok() == b.as_f64(),
        (a, b) => a == b,
    }
}

fn as_number(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok().filter(|f| f.is_finite()),
        _ => None,
    }
}

/// A configured value: its JSON text when short, else cut like [`render_short`].
fn render_value(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() <= 80 {
        s
    } else {
        render_short(v)
    }
}

/// Short JSON rendering for traces: long strings and containers are cut.
fn render_short(v: &Value) -> String {
    let s = match v {
        Value::Object(m) => format!("{{object with {} keys}}", m.len()),
        Value::Array(a) => format!("[array of {}]", a.len()),
        other => other.to_string(),
    };
    if s.chars().count() > 80 {
        let cut: String = s.chars().take(77).collect();
        format!("{cut}...")
    } else {
        s
    }
}

/// Split a dot path into segments; every segment must be non-empty.
pub fn parse_path(p: &str) -> Result<Vec<Seg>, String> {
    if p.is_empty() {
        return Err("path is empty; write e.g. `model` or `metadata.interactive`".into());
    }
    let segs: Vec<&str> = p.split('.').collect();
    if segs.iter().any(|s| s.is_empty()) {
        return Err(format!("path {p:?} has an empty segment (two dots, or a dot at an end)"));
    }
    if segs.len() > 32 {
        return Err(format!("path {p:?} is deeper than 32 segments"));
    }
    Ok(segs.into_iter().map(|s| Seg::Key(s.to_string())).collect())
}

/// Follow `segs` into `body`. An array is indexed by a numeric segment (negative counts from the
/// end); anything else that does not fit means the element is missing.
pub fn lookup<'a>(body: &'a Value, segs: &[Seg]) -> Option<&'a Value> {
    let mut cur = body;
    for Seg::Key(k) in segs {
        cur = match cur {
            Value::Object(m) => m.get(k)?,
            Value::Array(a) => {
                let i: i64 = k.parse().ok()?;
                let idx = if i < 0 { (a.len() as i64).checked_add(i)? } else { i };
                a.get(usize::try_from(idx).ok()?)?
            }
            _ => return None,
        };
    }
    Some(cur)
}

fn compile_cond(op: Op, value: Option<&Value>) -> Result<Cond, String> {
    let scalar = |v: &Value| matches!(v, Value::String(_) | Value::Number(_) | Value::Bool(_) | Value::Null);
    match (op, value) {
        (Op::Exists, None) => Ok(Cond::Exists),
        (Op::Exists, Some(_)) => Err("`exists` takes no value; remove `value`".into()),
        (_, None) => Err(format!("`{}` needs a `value`", op.as_str())),
        (Op::Equals, Some(v)) if scalar(v) => Ok(Cond::Equals(v.clone())),
        (Op::NotEquals, Some(v)) if scalar(v) => Ok(Cond::NotEquals(v.clone())),
        (Op::Equals | Op::NotEquals, Some(_)) => {
            Err(format!("`{}` compares with a string, number or boolean, not a list or map", op.as_str()))
        }
        (Op::OneOf, Some(Value::Array(xs))) if !xs.is_empty() && xs.iter().all(scalar) => {
            Ok(Cond::OneOf(xs.clone()))
        }
        (Op::OneOf, Some(_)) => Err("`one-of` needs a non-empty list of strings, numbers or booleans".into()),
        (Op::Prefix, Some(Value::String(p))) => Ok(Cond::Prefix(p.clone())),
        (Op::Prefix, Some(_)) => Err("`prefix` needs a string".into()),
        (Op::Regex, Some(Value::String(r))) => {
            // Size limits keep a hostile or careless pattern from eating memory at load.
            regex::RegexBuilder::new(r)
                .size_limit(1 << 20)
                .build()
                .map(Cond::Regex)
                .map_err(|e| format!("bad regex {r:?}: {e}"))
        }
        (Op::Regex, Some(_)) => Err("`regex` needs a string pattern".into()),
        (Op::LessThan | Op::GreaterThan, Some(v)) => match v.as_f64() {
            Some(n) if n.is_finite() => {
                Ok(if op == Op::LessThan { Cond::LessThan(n) } else { Cond::GreaterThan(n) })
            }
            _ => Err(format!("`{}` needs a number", op.as_str())),
        },
    }
}

type CompiledTarget = (Target, Option<Vec<(String, u32)>>);

fn compile_target(
    t: &TargetConfig,
    index: &HashMap<&str, usize>,
    pools: &[String],
) -> Result<CompiledTarget, String> {
    let n = t.step.is_some() as u8 + t.pool.is_some() as u8 + t.reject.is_some() as u8;
    if n != 1 {
        return Err("goes nowhere: give exactly one of `step: ID`, `pool: NAME` or `reject: STATUS`".into());
    }
    if t.model_split.is_some() && t.pool.is_none() {
        return Err("`model_split` only goes with `pool`".into());
    }
    if t.message.is_some() && t.reject.is_none() {
        return Err("`message` only goes with `reject`".into());
    }
    if let Some(id) = &t.step {
        return index
            .get(id.as_str())
            .map(|&i| (Target::Step(i), None))
            .ok_or_else(|| format!("no step has id {id:?}"));
    }
    if let Some(status) = t.reject {
        if !(400..=599).contains(&status) {
            return Err(format!("reject status {status} must be in 400..=599"));
        }
        let message =
            t.message.clone().unwrap_or_else(|| format!("request rejected by the routing table ({status})"));
        return Ok((Target::Reject { status, message }, None));
    }
    let pool = t.pool.clone().unwrap_or_default();
    if !pools.contains(&pool) {
        return Err(format!("no pool named {pool:?}; pools are: {}", pools.join(", ")));
    }
    let split = match &t.model_split {
        None => None,
        Some(m) => {
            let sum: u32 = m.values().copied().map(|v| v.min(100)).sum();
            if m.is_empty() || sum != 100 || m.values().any(|&v| v > 100) {
                return Err(format!("model_split percentages must add up to 100 (they add up to {sum})"));
            }
            if m.keys().any(|k| k.trim().is_empty()) {
                return Err("model_split has an empty model name".into());
            }
            Some(m.iter().map(|(k, v)| (k.clone(), *v)).collect())
        }
    };
    Ok((Target::Pool { pool, split: None }, split))
}

fn successors(s: &Step) -> impl Iterator<Item = usize> + '_ {
    let routes = s.guard.iter().flat_map(|g| g.route_steps.iter().map(|(i, _)| *i));
    [&s.on_match, &s.on_miss]
        .into_iter()
        .filter_map(|t| match t {
            Target::Step(i) => Some(*i),
            _ => None,
        })
        .chain(routes)
}

impl Step {
    /// Does this step compare the body's `model`?
    fn reads_model(&self) -> bool {
        matches!(&self.source, Source::Field { segs, .. } if segs.len() == 1 && segs[0] == Seg::Key("model".into()))
    }
}

/// A cycle reachable from anywhere, as the list of steps on it.
fn find_cycle(steps: &[Step], start: usize) -> Option<Vec<usize>> {
    // 0 = unvisited, 1 = on the current path, 2 = done. Iterative DFS so depth is not a concern.
    let mut color = vec![0u8; steps.len()];
    let order = std::iter::once(start).chain(0..steps.len());
    for root in order {
        if color[root] != 0 {
            continue;
        }
        let mut stack: Vec<(usize, Vec<usize>)> = vec![(root, successors(&steps[root]).collect())];
        color[root] = 1;
        while let Some((node, next)) = stack.last_mut() {
            let node = *node;
            if let Some(n) = next.pop() {
                match color[n] {
                    0 => {
                        color[n] = 1;
                        stack.push((n, successors(&steps[n]).collect()));
                    }
                    1 => {
                        let path: Vec<usize> = stack.iter().map(|(s, _)| *s).collect();
                        let from = path.iter().position(|&s| s == n).unwrap_or(0);
                        return Some(path[from..].to_vec());
                    }
                    _ => {}
                }
            } else {
                color[node] = 2;
                stack.pop();
            }
        }
    }
    None
}

fn reachable(steps: &[Step], start: usize) -> Vec<bool> {
    let mut seen = vec![false; steps.len()];
    let mut todo = vec![start];
    while let Some(i) = todo.pop() {
        if seen[i] {
            continue;
        }
        seen[i] = true;
        todo.extend(successors(&steps[i]));
    }
    seen
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn table(yaml: &str) -> Result<RouteTable, Vec<(String, String)>> {
        let cfg: RoutesConfig = serde_yaml_ng::from_str(yaml).expect("yaml");
        RouteTable::compile(&cfg, &["a".into(), "b".into(), "c".into()])
    }

    const THREE: &str = r#"
steps:
  - id: model
    field: model
    op: one-of
    value: [big, huge]
    match: { pool: a }
    miss: { step: system }
  - id: system
    field: messages.0.role
    op: equals
    value: system
    match: { pool: b }
    miss: { step: interactive }
  - id: interactive
    field: metadata.interactive
    op: equals
    value: true
    match: { pool: c }
    miss: { reject: 404, message: "no route" }
"#;

    #[test]
    fn walks_to_each_pool() {
        let t = table(THREE).unwrap();
        let h = HeaderMap::new();
        let d = t.evaluate(&json!({"model": "big"}), &h);
        assert_eq!(d.target, Target::Pool { pool: "a".into(), split: None });
        assert_eq!(d.route(&t), "model:match");
        let d = t.evaluate(&json!({"model": "x", "messages": [{"role": "system"}]}), &h);
        assert_eq!(d.target, Target::Pool { pool: "b".into(), split: None });
        let d = t.evaluate(&json!({"model": "x", "metadata": {"interactive": true}}), &h);
        assert_eq!(d.target, Target::Pool { pool: "c".into(), split: None });
        assert_eq!(d.route(&t), "model:miss,system:miss,interactive:match");
        let d = t.evaluate(&json!({"model": "x", "metadata": {"interactive": "yes"}}), &h);
        assert!(matches!(d.target, Target::Reject { status: 404, .. }));
        assert!(t
            .explain(&d)
            .contains("step interactive: metadata.interactive = \"yes\" equals true -> miss"));
    }

    #[test]
    fn guard_steps_are_validated_and_walked() {
        let bad = r#"
steps:
  - id: g
    field: model
    guard: { route_steps: [nope], route_pools: [zz] }
    match: { step: m }
    miss: { pool: a }
  - id: m
    field: model
    op: exists
    match: { pool: a }
    miss: { pool: b }
"#;
        let e = table(bad).unwrap_err();
        let text = format!("{e:?}");
        for want in ["takes no `field`", "has no `miss`", "needs a `url`", "route_steps[0]", "route_pools[0]"]
        {
            assert!(text.contains(want), "{want}: {text}");
        }
        let good = r#"
steps:
  - id: g
    guard: { deny: [ { regex: "(?i)drop table", status: 422 } ] }
    match: { step: m }
  - id: m
    field: model
    op: exists
    match: { pool: a }
    miss: { pool: b }
"#;
        let t = table(good).unwrap();
        let h = HeaderMap::new();
        let d = t.evaluate(&json!({"model": "x", "prompt": "DROP TABLE users"}), &h);
        assert!(matches!(d.target, Target::Reject { status: 422, .. }), "{d:?}");
        assert_eq!(d.route(&t), "g:deny-rule");
        let d = t.evaluate(&json!({"model": "x", "prompt": "hello"}), &h);
        assert_eq!(d.route(&t), "g:allow,m:match");
        assert!(
            t.explain(&d).contains("step g: guard (1 deny rule(s)) -> deny rules passed -> allow -> step m"),
            "{}",
            t.explain(&d)
        );
    }

    #[test]
    fn comparisons() {
        let v = |x: Value| x;
        assert!(Cond::Prefix("sql-".into()).test(&v(json!("sql-v2"))));
        assert!(!Cond::Prefix("sql-".into()).test(&v(json!(3))));
        assert!(Cond::LessThan(100.0).test(&json!(99)));
        assert!(Cond::GreaterThan(1.5).test(&json!("2")));
        assert!(!Cond::GreaterThan(1.5).test(&json!(true)));
        assert!(Cond::Equals(json!(true)).test(&json!("true")), "headers compare as text");
        assert!(Cond::Equals(json!(1)).test(&json!(1.0)));
        assert!(Cond::NotEquals(json!("a")).test(&json!("b")));
        assert!(Cond::OneOf(vec![json!("x"), json!(2)]).test(&json!(2)));
        assert!(Cond::Regex(Regex::new("^lo(ra)?-").unwrap()).test(&json!("lora-sql")));
    }

    #[test]
    fn paths_index_arrays_from_both_ends() {
        let body = json!({"messages": [{"role": "system"}, {"role": "user"}]});
        let p = |s: &str| parse_path(s).unwrap();
        assert_eq!(lookup(&body, &p("messages.0.role")), Some(&json!("system")));
        assert_eq!(lookup(&body, &p("messages.-1.role")), Some(&json!("user")));
        assert_eq!(lookup(&body, &p("messages.2.role")), None);
        assert_eq!(lookup(&body, &p("messages.-3.role")), None);
        assert_eq!(lookup(&body, &p("messages.x")), None);
        assert!(parse_path("a..b").is_err());
        assert!(parse_path("").is_err());
    }

    #[test]
    fn headers_are_a_source() {
        let t = table(
            "steps:\n  - id: h\n    header: X-Tier\n    op: equals\n    value: gold\n    match: { pool: a }\n    miss: { pool: b }\n",
        )
        .unwrap();
        let mut h = HeaderMap::new();
        h.insert("x-tier", "gold".parse().unwrap());
        assert_eq!(t.evaluate(&json!(null), &h).target, Target::Pool { pool: "a".into(), split: None });
        assert_eq!(
            t.evaluate(&json!(null), &HeaderMap::new()).target,
            Target::Pool { pool: "b".into(), split: None }
        );
    }

    fn errors(yaml: &str) -> String {
        table(yaml).unwrap_err().iter().map(|(f, m)| format!("{f}: {m}")).collect::<Vec<_>>().join("\n")
    }

    #[test]
    fn validation_names_the_step() {
        let step = |id: &str, extra: &str, m: &str, x: &str| {
            format!("  - id: {id}\n    field: model\n{extra}    match: {m}\n    miss: {x}\n")
        };
        let eq = "    op: equals\n    value: x\n";
        // Unknown step id.
        let e = errors(&format!("steps:\n{}", step("s1", eq, "{ step: nope }", "{ pool: a }")));
        assert!(e.contains("step \"s1\"") && e.contains("no step has id \"nope\""), "{e}");
        // Cycle.
        let e = errors(&format!(
            "steps:\n{}{}",
            step("s1", eq, "{ step: s2 }", "{ pool: a }"),
            step("s2", eq, "{ step: s1 }", "{ pool: a }")
        ));
        assert!(e.contains("cycle: s1 -> s2 -> s1") || e.contains("cycle: s2 -> s1 -> s2"), "{e}");
        // Unreachable.
        let e = errors(&format!(
            "steps:\n{}{}",
            step("s1", eq, "{ pool: b }", "{ pool: a }"),
            step("lonely", eq, "{ pool: a }", "{ pool: a }")
        ));
        assert!(e.contains("step \"lonely\"") && e.contains("unreachable"), "{e}");
        // Goes nowhere.
        let e = errors(&format!("steps:\n{}", step("s1", eq, "{}", "{ pool: a }")));
        assert!(e.contains("s1") && e.contains("goes nowhere"), "{e}");
        // Unknown pool.
        let e = errors(&format!("steps:\n{}", step("s1", eq, "{ pool: zz }", "{ pool: a }")));
        assert!(e.contains("no pool named \"zz\""), "{e}");
        // Bad regex.
        let e = errors(&format!(
            "steps:\n{}",
            step("s1", "    op: regex\n    value: \"(\"\n", "{ pool: a }", "{ pool: a }")
        ));
        assert!(e.contains("s1") && e.contains("bad regex"), "{e}");
        // Empty path segment.
        let e = errors("steps:\n  - id: s1\n    field: a..b\n    op: exists\n    match: { pool: a }\n    miss: { pool: a }\n");
        assert!(e.contains("s1") && e.contains("empty segment"), "{e}");
        // Bad split.
        let e = errors(&format!(
            "steps:\n{}",
            step("s1", eq, "{ pool: a, model_split: { v1: 90, v2: 20 } }", "{ pool: a }")
        ));
        assert!(e.contains("add up to 100"), "{e}");
        // Duplicate id and bad start.
        let e = errors(&format!(
            "start: zz\nsteps:\n{}{}",
            step("s1", eq, "{ pool: a }", "{ pool: a }"),
            step("s1", eq, "{ pool: a }", "{ pool: a }")
        ));
        assert!(e.contains("also used by") && e.contains("routes.start"), "{e}");
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            any::<f64>()
                .prop_map(|f| serde_json::Number::from_f64(f).map(Value::Number).unwrap_or(Value::Null)),
            "[a-z0-9 -]{0,12}".prop_map(Value::String),
            prop_oneof![Just("system"), Just("big"), Just("user"), Just("true")].prop_map(|s| json!(s)),
        ];
        leaf.prop_recursive(5, 64, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::btree_map(
                    prop_oneof![
                        Just("model".to_string()),
                        Just("messages".to_string()),
                        Just("metadata".to_string()),
                        Just("role".to_string()),
                        Just("0".to_string()),
                        Just("interactive".to_string()),
                        "[a-z]{1,4}"
                    ],
                    inner,
                    0..6
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
        #[test]
        fn evaluation_is_bounded_and_total_on_any_json(body in arb_json()) {
            let t = table(THREE).unwrap();
            let d = t.evaluate(&body, &HeaderMap::new());
            prop_assert!(!d.hops.is_empty() && d.hops.len() <= t.steps.len());
            prop_assert!(!matches!(d.target, Target::Step(_)));
            let _ = t.explain(&d);
        }
    }
}
