//! What a picker dispatched and what is still in flight, per member: requests (released when the
//! answer ends) and uncached prompt tokens (released at the first token, when the prefill that
//! cost them is done, as llm-d's in-flight load producer does for streaming answers). A picker
//! knows this exactly and at once, where the engines' own gauges are a scrape old.

use std::collections::HashMap;

/// Per-member in-flight load from the picker's own dispatches.
#[derive(Debug, Clone, Default)]
pub struct Accounting {
    /// Request id -> (member, uncached prompt tokens still counted).
    open: HashMap<u64, (usize, u64)>,
    requests: Vec<u32>,
    tokens: Vec<u64>,
}

impl Accounting {
    /// Accounting for a pool of `members`.
    pub fn new(members: usize) -> Accounting {
        Accounting { open: HashMap::new(), requests: vec![0; members], tokens: vec![0; members] }
    }

    /// Request `id` was sent to `member` with `uncached` prompt tokens to prefill there. An id
    /// seen before is released first (a caller that reuses ids never leaks load). A member out of
    /// range is ignored.
    pub fn dispatched(&mut self, id: u64, member: usize, uncached: u64) {
        self.finished(id);
        if member < self.requests.len() {
            self.open.insert(id, (member, uncached));
            self.requests[member] += 1;
            self.tokens[member] += uncached;
        }
    }

    /// Request `id`'s first token arrived: its prefill is done, its prompt tokens no longer load
    /// the member (the request still does).
    pub fn first_token(&mut self, id: u64) {
        if let Some((member, tokens)) = self.open.get_mut(&id) {
            self.tokens[*member] -= *tokens;
            *tokens = 0;
        }
    }

    /// Request `id` ended (answered, failed or abandoned): nothing of it is in flight any more.
    /// Unknown ids are ignored, so a double release is harmless.
    pub fn finished(&mut self, id: u64) {
        if let Some((member, tokens)) = self.open.remove(&id) {
            self.requests[member] -= 1;
            self.tokens[member] -= tokens;
        }
    }

    /// Requests in flight on `member`.
    pub fn requests(&self, member: usize) -> u32 {
        self.requests.get(member).copied().unwrap_or(0)
    }

    /// Uncached prompt tokens in flight on `member` (sent, first token not yet back).
    pub fn tokens(&self, member: usize) -> u64 {
        self.tokens.get(member).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_leave_at_the_first_token_requests_at_the_end() {
        let mut a = Accounting::new(2);
        a.dispatched(1, 0, 500);
        a.dispatched(2, 0, 300);
        a.dispatched(3, 1, 100);
        assert_eq!((a.requests(0), a.tokens(0), a.requests(1), a.tokens(1)), (2, 800, 1, 100));
        a.first_token(1);
        assert_eq!((a.requests(0), a.tokens(0)), (2, 300));
        a.finished(1);
        a.finished(1);
        a.first_token(1);
        assert_eq!((a.requests(0), a.tokens(0)), (1, 300), "a second release changes nothing");
        // Ended before its first token (a client that went away): both go.
        a.finished(2);
        assert_eq!((a.requests(0), a.tokens(0)), (0, 0));
        // An id reused, and a member out of range.
        a.dispatched(3, 0, 50);
        a.dispatched(9, 7, 50);
        assert_eq!((a.requests(0), a.tokens(0), a.requests(1), a.tokens(1), a.requests(7)), (1, 50, 0, 0, 0));
    }
}
