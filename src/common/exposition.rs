//! Streaming reader of Prometheus text exposition (format 0.0.4 and OpenMetrics 1.0) that extracts
//! only the sample names a profile needs.
//!
//! Why not a full parser: a model server's page is mostly histogram buckets nobody here reads, and
//! the page may come from an exporter that merges registries or appends hand-written lines. A full
//! parser builds the whole page in memory, refuses pages Prometheus itself ingests (samples without a
//! TYPE line, families whose samples have different label names, duplicated series) and, with the
//! pest-based crate used before, cost ~2 ms per ordinary page and grew faster than the page.
//!
//! This reader is a line scanner fed chunk by chunk as the body arrives (so the caller can await
//! between chunks and a deadline can interrupt it). Per line it finds the sample name; lines of any
//! other name, comments and `HELP`/`TYPE` lines are skipped without further parsing. Lines of a wanted
//! name are parsed fully (labels with escapes, value, optional timestamp, optional OpenMetrics
//! exemplar) and a malformed one makes the whole page unreadable: silently dropping one engine's
//! series would under-report the load. A series repeated with the same label set counts once (the
//! first, as Prometheus keeps the first sample of a duplicate). The body is capped; past the cap the
//! page is refused, never truncated.

use std::collections::HashSet;
use std::fmt;

/// Default cap on a metrics page: a vLLM page is ~15 KB; anything past a few MB is not a model
/// server's page.
pub const DEFAULT_MAX_BYTES: usize = 4 * 1024 * 1024;

/// The sample names to read, e.g. `vllm:num_requests_waiting` or a histogram's
/// `vllm:e2e_request_latency_seconds_sum`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Wanted {
    names: Vec<Box<[u8]>>,
}

impl Wanted {
    pub fn new<S: AsRef<str>>(names: impl IntoIterator<Item = S>) -> Wanted {
        let mut w = Wanted::default();
        for n in names {
            w.add(n.as_ref());
        }
        w
    }

    pub fn add(&mut self, name: &str) {
        if self.index(name.as_bytes()).is_none() {
            self.names.push(name.as_bytes().into());
        }
    }

    fn index(&self, name: &[u8]) -> Option<usize> {
        // A handful of names: a linear scan beats hashing each line's name.
        self.names.iter().position(|n| **n == *name)
    }
}

/// Sum and number of the distinct series of one sample name.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Total {
    pub sum: f64,
    pub series: usize,
}

impl Total {
    pub fn mean(&self) -> f64 {
        self.sum / self.series as f64
    }
}

/// What a page said about the wanted names.
#[derive(Debug, Clone, PartialEq)]
pub struct Reading {
    wanted: Wanted,
    totals: Vec<Total>,
}

impl Reading {
    /// The total of `name` over its series; `None` when the page has no sample of it (or it was not
    /// wanted).
    pub fn get(&self, name: &str) -> Option<Total> {
        let i = self.wanted.index(name.as_bytes())?;
        let t = self.totals[i];
        (t.series > 0).then_some(t)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadError {
    /// The body passed the cap.
    TooLarge { limit: usize },
    /// A line of a wanted name is not a valid sample.
    Malformed { line: usize, detail: String },
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::TooLarge { limit } => {
                write!(f, "metrics page larger than {limit} bytes (the source's max_body_bytes)")
            }
            ReadError::Malformed { line, detail } => write!(f, "line {line}: {detail}"),
        }
    }
}

/// Incremental reader: [`feed`](Reader::feed) chunks as they arrive, then [`finish`](Reader::finish).
pub struct Reader {
    wanted: Wanted,
    totals: Vec<Total>,
    /// (wanted index, canonical label set) of every series counted, for duplicate detection.
    seen: HashSet<(usize, Vec<u8>)>,
    /// The start of a line whose end has not arrived yet.
    partial: Vec<u8>,
    bytes: usize,
    limit: usize,
    line_no: usize,
    /// OpenMetrics `# EOF` seen: the rest is ignored.
    eof: bool,
}

impl Reader {
    pub fn new(wanted: Wanted, limit: usize) -> Reader {
        let totals = vec![Total::default(); wanted.names.len()];
        Reader {
            wanted,
            totals,
            seen: HashSet::new(),
            partial: Vec::new(),
            bytes: 0,
            limit,
            line_no: 0,
            eof: false,
        }
    }

    pub fn feed(&mut self, mut chunk: &[u8]) -> Result<(), ReadError> {
        self.bytes = self.bytes.saturating_add(chunk.len());
        if self.bytes > self.limit {
            return Err(ReadError::TooLarge { limit: self.limit });
        }
        if !self.partial.is_empty() {
            match memchr::memchr(b'\n', chunk) {
                None => {
                    self.partial.extend_from_slice(chunk);
                    return Ok(());
                }
                Some(i) => {
                    let mut line = std::mem::take(&mut self.partial);
                    line.extend_from_slice(&chunk[..i]);
                    self.line(&line)?;
                    // Keep the allocation for the next partial line.
                    line.clear();
                    self.partial = line;
                    chunk = &chunk[i + 1..];
                }
            }
        }
        while let Some(i) = memchr::memchr(b'\n', chunk) {
            self.line(&chunk[..i])?;
            chunk = &chunk[i + 1..];
        }
        self.partial.extend_from_slice(chunk);
        Ok(())
    }

    /// The last line may lack its newline (some exporters omit it).
    pub fn finish(mut self) -> Result<Reading, ReadError> {
        if !self.partial.is_empty() {
            let line = std::mem::take(&mut self.partial);
            self.line(&line)?;
        }
        Ok(Reading { wanted: self.wanted, totals: self.totals })
    }

    fn line(&mut self, line: &[u8]) -> Result<(), ReadError> {
        self.line_no += 1;
        if self.eof {
            return Ok(());
        }
        let line = trim_start(line.strip_suffix(b"\r").unwrap_or(line));
        match line.first() {
            None => Ok(()),
            Some(b'#') => {
                if line.starts_with(b"# EOF") && trim_start(&line[5..]).is_empty() {
                    self.eof = true;
                }
                Ok(())
            }
            Some(b'{') => {
                // Prometheus 3 UTF-8 form: `{"name.with.dots", label="v"} 1`. The name is the first
                // quoted string without `=`; anything else is not a sample we can name, so skip it.
                let mut p = Parser { s: line, i: 1 };
                p.ws();
                let Ok(name) = p.quoted() else { return Ok(()) };
                p.ws();
                if !matches!(p.peek(), Some(b',' | b'}')) {
                    return Ok(());
                }
                let Some(idx) = self.wanted.index(&name) else { return Ok(()) };
                self.sample(idx, line, 1, true)
            }
            Some(_) => {
                let end = line.iter().position(|&b| matches!(b, b'{' | b' ' | b'\t')).unwrap_or(line.len());
                let Some(idx) = self.wanted.index(&line[..end]) else { return Ok(()) };
                if !valid_metric_name(&line[..end]) {
                    return Err(self.malformed("invalid metric name"));
                }
                self.sample(idx, line, end, false)
            }
        }
    }

    fn malformed(&self, detail: impl Into<String>) -> ReadError {
        ReadError::Malformed { line: self.line_no, detail: detail.into() }
    }

    /// Parse the rest of a wanted sample line from `at` (the `{`, or whitespace before the value).
    fn sample(&mut self, idx: usize, line: &[u8], at: usize, braced_name: bool) -> Result<(), ReadError> {
        let mut p = Parser { s: line, i: at };
        let mut labels: Vec<(Vec<u8>, &[u8])> = Vec::new();
        let spaced = if braced_name {
            // Already checked: a quoted name, then `,` or `}`.
            let _ = p.quoted();
            p.ws();
            if p.peek() == Some(b',') {
                p.i += 1;
            }
            p.labels(&mut labels).map_err(|e| self.malformed(e))?;
            p.ws()
        } else {
            let spaced = p.ws();
            if p.peek() == Some(b'{') {
                p.i += 1;
                p.labels(&mut labels).map_err(|e| self.malformed(e))?;
                p.ws()
            } else {
                spaced
            }
        };
        if !spaced {
            return Err(self.malformed("expected whitespace before the value"));
        }
        let value = p.token();
        let value = parse_float(value).ok_or_else(|| {
            self.malformed(format!("value {:?} is not a number", String::from_utf8_lossy(value)))
        })?;
        p.ws();
        // Optional timestamp (integer milliseconds in 0.0.4, float seconds in OpenMetrics), then an
        // optional OpenMetrics exemplar `# {...} value [ts]`, which we do not need.
        if p.peek().is_some_and(|b| b != b'#') {
            let ts = p.token();
            if parse_float(ts).is_none_or(|t| !t.is_finite()) {
                return Err(
                    self.malformed(format!("timestamp {:?} is not a number", String::from_utf8_lossy(ts)))
                );
            }
            p.ws();
        }
        if p.peek().is_some_and(|b| b != b'#') {
            return Err(self.malformed("unexpected text after the sample"));
        }
        labels.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let mut key = Vec::with_capacity(labels.iter().map(|(k, v)| k.len() + v.len() + 2).sum());
        for (k, v) in &labels {
            key.extend_from_slice(k);
            key.push(0xff);
            key.extend_from_slice(v);
            key.push(0xfe);
        }
        if self.seen.insert((idx, key)) {
            let t = &mut self.totals[idx];
            t.sum += value;
            t.series += 1;
        }
        Ok(())
    }
}

/// Read a whole body at once (tests, or a page already in memory).
pub fn read(body: &[u8], wanted: Wanted, limit: usize) -> Result<Reading, ReadError> {
    let mut r = Reader::new(wanted, limit);
    r.feed(body)?;
    r.finish()
}

fn trim_start(s: &[u8]) -> &[u8] {
    let n = s.iter().take_while(|b| matches!(b, b' ' | b'\t')).count();
    &s[n..]
}

fn valid_metric_name(s: &[u8]) -> bool {
    match s.split_first() {
        Some((first, rest)) => {
            (first.is_ascii_alphabetic() || matches!(first, b'_' | b':'))
                && rest.iter().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b':'))
        }
        None => false,
    }
}

fn valid_label_name(s: &[u8]) -> bool {
    match s.split_first() {
        Some((first, rest)) => {
            (first.is_ascii_alphabetic() || *first == b'_')
                && rest.iter().all(|b| b.is_ascii_alphanumeric() || *b == b'_')
        }
        None => false,
    }
}

/// A float as Go's `strconv.ParseFloat` (Prometheus) reads it, for the forms exporters write:
/// decimal, exponent, `NaN`, `+Inf`, `-Inf` (any case).
fn parse_float(s: &[u8]) -> Option<f64> {
    let s = std::str::from_utf8(s).ok()?;
    if s.is_empty() {
        return None;
    }
    s.parse::<f64>().ok()
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    /// Skip spaces and tabs; whether any were skipped.
    fn ws(&mut self) -> bool {
        let start = self.i;
        while matches!(self.peek(), Some(b' ' | b'\t')) {
            self.i += 1;
        }
        self.i > start
    }

    /// Bytes up to the next whitespace.
    fn token(&mut self) -> &'a [u8] {
        let start = self.i;
        while self.peek().is_some_and(|b| b != b' ' && b != b'\t') {
            self.i += 1;
        }
        &self.s[start..self.i]
    }

    /// A double-quoted string, unescaped (`\\`, `\"`, `\n`; other escapes keep the character).
    fn quoted(&mut self) -> Result<Vec<u8>, String> {
        if self.peek() != Some(b'"') {
            return Err("expected '\"'".into());
        }
        self.i += 1;
        let mut out = Vec::new();
        loop {
            match self.peek() {
                None => return Err("unterminated quoted string".into()),
                Some(b'"') => {
                    self.i += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    let Some(&c) = self.s.get(self.i + 1) else {
                        return Err("unterminated escape".into());
                    };
                    out.push(if c == b'n' { b'\n' } else { c });
                    self.i += 2;
                }
                Some(c) => {
                    out.push(c);
                    self.i += 1;
                }
            }
        }
    }

    /// The raw bytes of a quoted label value (escapes kept: they are canonical for duplicate
    /// detection, and we never need the value itself).
    fn raw_quoted(&mut self) -> Result<&'a [u8], String> {
        if self.peek() != Some(b'"') {
            return Err("expected '\"' to open a label value".into());
        }
        self.i += 1;
        let start = self.i;
        loop {
            match self.peek() {
                None => return Err("unterminated label value".into()),
                Some(b'"') => {
                    let v = &self.s[start..self.i];
                    self.i += 1;
                    return Ok(v);
                }
                Some(b'\\') => {
                    if self.i + 1 >= self.s.len() {
                        return Err("unterminated escape in a label value".into());
                    }
                    self.i += 2;
                }
                Some(_) => self.i += 1,
            }
        }
    }

    /// `name="value",...}` after the opening brace (a trailing comma is allowed).
    fn labels(&mut self, out: &mut Vec<(Vec<u8>, &'a [u8])>) -> Result<(), String> {
        loop {
            self.ws();
            match self.peek() {
                Some(b'}') => {
                    self.i += 1;
                    return Ok(());
                }
                None => return Err("missing '}'".into()),
                _ => {}
            }
            let name = if self.peek() == Some(b'"') {
                self.quoted()?
            } else {
                let start = self.i;
                while self.peek().is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_') {
                    self.i += 1;
                }
                let n = &self.s[start..self.i];
                if !valid_label_name(n) {
                    return Err(format!("invalid label name at byte {}", start + 1));
                }
                n.to_vec()
            };
            self.ws();
            if self.peek() != Some(b'=') {
                return Err(format!("expected '=' after label {:?}", String::from_utf8_lossy(&name)));
            }
            self.i += 1;
            self.ws();
            let value = self.raw_quoted()?;
            out.push((name, value));
            self.ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b'}') => {}
                _ => return Err("expected ',' or '}' after a label value".into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(names: &[&str]) -> Wanted {
        Wanted::new(names.iter().copied())
    }

    fn total(r: &Reading, n: &str) -> Option<(f64, usize)> {
        r.get(n).map(|t| (t.sum, t.series))
    }

    #[test]
    fn reads_only_wanted_names_and_skips_everything_else_unparsed() {
        let page = "# HELP a x\n# TYPE a gauge\na{x=\"1\"} 2\na{x=\"2\"} 3.5\nb{not even valid 7\nc 1\n";
        let r = read(page.as_bytes(), w(&["a", "c", "d"]), 1 << 20).expect("reads");
        assert_eq!(total(&r, "a"), Some((5.5, 2)));
        assert_eq!(total(&r, "c"), Some((1.0, 1)));
        assert_eq!(total(&r, "d"), None);
        assert_eq!(total(&r, "b"), None, "not wanted");
    }

    #[test]
    fn odd_but_valid_pages_are_read() {
        // No TYPE lines, labels differing inside a family, a duplicated series (first kept, label
        // order irrelevant), escapes with braces and commas in values, `_total`/`_created` twins,
        // timestamps, CRLF, an exemplar, a trailing comma, a missing final newline.
        let page = concat!(
            "vllm:num_requests_waiting{engine=\"0\",model_name=\"a \\\"b\\\" {c}, d\\\\\"} 3\n",
            "vllm:num_requests_waiting{model_name=\"a \\\"b\\\" {c}, d\\\\\",engine=\"0\"} 99\n",
            "vllm:num_requests_waiting{engine=\"1\"} 2 1700000000000\r\n",
            "vllm:num_requests_waiting {pod=\"x\",} 1.5e0\n",
            "vllm:request_success_total{engine=\"0\"} 12\n",
            "vllm:request_success_created{engine=\"0\"} 1.7e9\n",
            "vllm:e2e_request_latency_seconds_count{engine=\"0\"} 4 # {trace_id=\"x\"} 1.0 1.7e9\n",
            "  vllm:e2e_request_latency_seconds_sum\t8",
        );
        let r = read(
            page.as_bytes(),
            w(&[
                "vllm:num_requests_waiting",
                "vllm:request_success_total",
                "vllm:e2e_request_latency_seconds_sum",
                "vllm:e2e_request_latency_seconds_count",
            ]),
            1 << 20,
        )
        .expect("reads");
        assert_eq!(total(&r, "vllm:num_requests_waiting"), Some((6.5, 3)));
        assert_eq!(total(&r, "vllm:request_success_total"), Some((12.0, 1)));
        assert_eq!(total(&r, "vllm:e2e_request_latency_seconds_sum"), Some((8.0, 1)));
        assert_eq!(total(&r, "vllm:e2e_request_latency_seconds_count"), Some((4.0, 1)));
    }

    #[test]
    fn openmetrics_eof_and_utf8_names() {
        let page = "{\"my.queue\",engine=\"0\"} 4\n{\"my.queue\"} 1\nq 1\n# EOF\nq 100\n";
        let r = read(page.as_bytes(), w(&["my.queue", "q"]), 1 << 20).expect("reads");
        assert_eq!(total(&r, "my.queue"), Some((5.0, 2)));
        assert_eq!(total(&r, "q"), Some((1.0, 1)), "lines after # EOF are ignored");
    }

    #[test]
    fn special_values_are_numbers() {
        let page = "a NaN\nb +Inf\nc -Inf\n";
        let r = read(page.as_bytes(), w(&["a", "b", "c"]), 1 << 20).expect("reads");
        assert!(r.get("a").expect("a").sum.is_nan());
        assert_eq!(r.get("b").expect("b").sum, f64::INFINITY);
        assert_eq!(r.get("c").expect("c").sum, f64::NEG_INFINITY);
    }

    #[test]
    fn malformed_wanted_lines_are_errors_naming_the_line() {
        for bad in [
            "a{x=\"1\" 3\n",
            "a{x=1} 3\n",
            "a{x=\"1\"}\n",
            "a{x=\"1\"} three\n",
            "a 1 2 3\n",
            "a 1 notatime\n",
            "a{1x=\"v\"} 1\n",
            "a{x=\"v} 1\n",
        ] {
            let page = format!("ok 1\n{bad}");
            match read(page.as_bytes(), w(&["a"]), 1 << 20) {
                Err(ReadError::Malformed { line: 2, .. }) => {}
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn cap_is_enforced_across_chunks() {
        let mut r = Reader::new(w(&["a"]), 10);
        r.feed(b"a 1\na").expect("under the cap");
        assert_eq!(r.feed(b" 2\nbbbb\n"), Err(ReadError::TooLarge { limit: 10 }));
    }

    #[test]
    fn lines_split_across_chunks_are_joined() {
        let page = b"x{a=\"1\"} 1\nwanted{a=\"1\"} 2\nwanted{a=\"2\"} 3\n";
        for split in 0..page.len() {
            let mut r = Reader::new(w(&["wanted"]), 1 << 20);
            r.feed(&page[..split]).expect("first");
            r.feed(&page[split..]).expect("second");
            assert_eq!(total(&r.finish().expect("finish"), "wanted"), Some((5.0, 2)), "split at {split}");
        }
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        fn escape(v: &str) -> String {
            v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
        }

        /// One generated sample line: name index, labels, value, and how to decorate it.
        #[derive(Debug, Clone)]
        struct Line {
            name: usize,
            labels: Vec<(String, String)>,
            value: f64,
            style: u8,
            timestamp: Option<i64>,
            exemplar: bool,
        }

        // Wanted names first; the others share prefixes with them, as real pages' twins do.
        const NAMES: &[&str] = &[
            "vllm:num_requests_waiting",
            "lat_sum",
            "lat_count",
            "vllm:num_requests_waiting_total",
            "vllm:num_requests_waitin",
            "lat_bucket",
            "lat_created",
            "other",
        ];
        const WANTED: usize = 3;

        fn line() -> impl Strategy<Value = Line> {
            (
                0..NAMES.len(),
                proptest::collection::vec(("[a-z_][a-z0-9_]{0,6}", any::<String>()), 0..4),
                -1e12f64..1e12,
                0u8..4,
                proptest::option::of(0i64..2_000_000_000_000),
                any::<bool>(),
            )
                .prop_map(|(name, labels, value, style, timestamp, exemplar)| {
                    // Distinct label names within one sample.
                    let mut seen = std::collections::HashSet::new();
                    let labels = labels.into_iter().filter(|(k, _)| seen.insert(k.clone())).collect();
                    Line { name, labels, value, style, timestamp, exemplar }
                })
        }

        fn render(l: &Line) -> String {
            let value = match l.style {
                0 => format!("{}", l.value),
                1 => format!("{:e}", l.value),
                2 => format!("{:?}", l.value),
                _ => format!("{:E}", l.value),
            };
            let labels: Vec<String> =
                l.labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
            let mut s = NAMES[l.name].to_string();
            if !labels.is_empty() || l.style == 3 {
                s.push('{');
                s.push_str(&labels.join(","));
                s.push('}');
            }
            s.push(' ');
            s.push_str(&value);
            if let Some(t) = l.timestamp {
                s.push_str(&format!(" {t}"));
            }
            if l.exemplar {
                s.push_str(" # {trace_id=\"abc\"} 0.5");
            }
            s
        }

        proptest! {
            #![proptest_config(ProptestConfig {
                cases: 256,
                rng_seed: proptest::test_runner::RngSeed::Fixed(14),
                ..ProptestConfig::default()
            })]

            #[test]
            fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..2048), split in 0usize..2048) {
                let wanted = Wanted::new(NAMES[..WANTED].iter().copied());
                let _ = read(&body, wanted.clone(), 1 << 20);
                let mut r = Reader::new(wanted, 1 << 20);
                let at = split.min(body.len());
                if r.feed(&body[..at]).is_ok() && r.feed(&body[at..]).is_ok() {
                    let _ = r.finish();
                }
            }

            #[test]
            fn arbitrary_text_with_wanted_names_never_panics(
                parts in proptest::collection::vec(prop_oneof![
                    Just("vllm:num_requests_waiting".to_string()),
                    Just("{".to_string()), Just("}".to_string()), Just("\"".to_string()),
                    Just("\\".to_string()), Just("=".to_string()), Just(",".to_string()),
                    Just(" ".to_string()), Just("\n".to_string()), Just("#".to_string()),
                    "[a-z0-9.+-]{0,4}",
                ], 0..64)
            ) {
                let body = parts.concat();
                let _ = read(body.as_bytes(), Wanted::new(NAMES[..WANTED].iter().copied()), 1 << 20);
            }

            #[test]
            fn generated_valid_pages_are_read_exactly(
                lines in proptest::collection::vec(line(), 0..40),
                openmetrics in any::<bool>(),
                typed in any::<bool>(),
                chunks in proptest::collection::vec(1usize..64, 0..20),
            ) {
                let mut page = String::new();
                let mut expected = [(0.0f64, 0usize); WANTED];
                let mut seen = std::collections::HashSet::new();
                for (i, l) in lines.iter().enumerate() {
                    if typed && i % 5 == 0 {
                        page.push_str(&format!("# HELP {} help with \\n and \"quotes\"\n# TYPE {} gauge\n", NAMES[l.name], NAMES[l.name]));
                    }
                    page.push_str(&render(l));
                    page.push('\n');
                    if l.name < WANTED {
                        let mut key: Vec<(String, String)> = l.labels.clone();
                        key.sort();
                        if seen.insert((l.name, key)) {
                            expected[l.name].0 += l.value;
                            expected[l.name].1 += 1;
                        }
                    }
                }
                if openmetrics {
                    page.push_str("# EOF\n");
                }
                let mut r = Reader::new(Wanted::new(NAMES[..WANTED].iter().copied()), 1 << 20);
                let mut rest = page.as_bytes();
                for c in chunks {
                    let c = c.min(rest.len());
                    r.feed(&rest[..c]).map_err(|e| TestCaseError::fail(format!("{e}\n{page}")))?;
                    rest = &rest[c..];
                }
                r.feed(rest).map_err(|e| TestCaseError::fail(format!("{e}\n{page}")))?;
                let reading = r.finish().map_err(|e| TestCaseError::fail(format!("{e}\n{page}")))?;
                for (i, (sum, n)) in expected.iter().enumerate() {
                    let got = reading.get(NAMES[i]).map(|t| (t.sum, t.series));
                    let want = (*n > 0).then_some((*sum, *n));
                    prop_assert_eq!(got, want, "{} in\n{}", NAMES[i], page);
                }
            }
        }
    }
}
