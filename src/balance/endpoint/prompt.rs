//! What the endpoint picker reads of a request's body (in the proxy and behind every load
//! balancer's door): its prompt as a chain of block hashes, the way an engine's prefix cache sees
//! it, without a tokenizer.
//!
//! The prompt is the model name, then every message's role and text in order (or the completion
//! prompt), as bytes, cut into blocks of [`BLOCK_BYTES`] (about an engine's 16-token block at four
//! bytes a token). Each block's hash covers every byte before it, so two requests share a block
//! only when they share everything up to its end, as in the engine. Only the first `max_blocks`
//! blocks are hashed: a 10 MB prompt costs what a 256 KB one does; its length still counts.

use serde_json::Value;

use llm_lc_common::{fnv1a64, splitmix64};

/// Bytes of prompt per block.
pub const BLOCK_BYTES: usize = 64;
/// Bytes per token, for the picker's token counts (English text through a BPE tokenizer).
pub const BYTES_PER_TOKEN: u64 = 4;

/// A request's prompt as the picker needs it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromptBlocks {
    /// Hash chain of the prompt's whole blocks, at most `max_blocks` of them.
    pub blocks: Vec<u64>,
    /// The whole prompt's length in tokens (estimated from its bytes).
    pub tokens: u64,
}

/// Tokens per block ([`BLOCK_BYTES`] / [`BYTES_PER_TOKEN`]).
pub const BLOCK_TOKENS: u64 = BLOCK_BYTES as u64 / BYTES_PER_TOKEN;

/// The prompt of a chat or completion body, `None` when it has none.
pub fn prompt_blocks(body: &Value, max_blocks: usize) -> Option<PromptBlocks> {
    let mut chain = Chain { max_blocks, ..Chain::default() };
    chain.feed(body.get("model").and_then(Value::as_str).unwrap_or("").as_bytes());
    chain.feed(&[0]);
    let before = chain.total;
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        for m in messages {
            chain.feed(m.get("role").and_then(Value::as_str).unwrap_or("").as_bytes());
            chain.feed(&[0]);
            match m.get("content") {
                Some(Value::String(s)) => chain.feed(s.as_bytes()),
                Some(Value::Array(parts)) => {
                    for text in parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)) {
                        chain.feed(text.as_bytes());
                    }
                }
                _ => {}
            }
            chain.feed(&[0]);
        }
    } else {
        match body.get("prompt") {
            Some(Value::String(s)) => chain.feed(s.as_bytes()),
            Some(Value::Array(items)) => {
                for s in items.iter().filter_map(Value::as_str) {
                    chain.feed(s.as_bytes());
                    chain.feed(&[0]);
                }
            }
            _ => {}
        }
    }
    (chain.total > before)
        .then(|| PromptBlocks { tokens: chain.total.div_ceil(BYTES_PER_TOKEN), blocks: chain.blocks })
}

/// The prompt of a request body as a door receives it: a whole JSON body is read as
/// [`prompt_blocks`] reads it; anything else (the first bytes a load balancer buffered, cut
/// mid-JSON, or a body that is not JSON) is hashed as raw bytes. A client serialises its requests
/// alike, so the raw bytes of two requests share a leading run exactly where their prompts do,
/// and the chain still finds the prefix; it is only not the chain a whole body gives.
/// `None` for an empty body or a JSON body without a prompt.
pub fn body_blocks(body: &[u8], max_blocks: usize) -> Option<PromptBlocks> {
    if body.is_empty() {
        return None;
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(v) => prompt_blocks(&v, max_blocks),
        Err(_) => {
            let mut chain = Chain { max_blocks, ..Chain::default() };
            chain.feed(body);
            Some(PromptBlocks { tokens: chain.total.div_ceil(BYTES_PER_TOKEN), blocks: chain.blocks })
        }
    }
}

/// The running hash chain.
#[derive(Default)]
struct Chain {
    blocks: Vec<u64>,
    /// Bytes of the block being filled.
    pending: Vec<u8>,
    last: u64,
    total: u64,
    max_blocks: usize,
}

impl Chain {
    fn feed(&mut self, mut bytes: &[u8]) {
        self.total += bytes.len() as u64;
        while !bytes.is_empty() && self.blocks.len() < self.max_blocks {
            let take = (BLOCK_BYTES - self.pending.len()).min(bytes.len());
            self.pending.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.pending.len() == BLOCK_BYTES {
                self.last = splitmix64(self.last ^ fnv1a64(&self.pending));
                self.blocks.push(self.last);
                self.pending.clear();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn chat(system: &str, user: &str) -> Value {
        json!({"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
    }

    #[test]
    fn requests_share_the_blocks_of_what_they_share_and_no_more() {
        let doc = "a long shared system prompt. ".repeat(40);
        let a = prompt_blocks(&chat(&doc, "first question"), 4096).expect("a prompt");
        let b = prompt_blocks(&chat(&doc, "another question entirely"), 4096).expect("a prompt");
        let shared = a.blocks.iter().zip(&b.blocks).take_while(|(x, y)| x == y).count();
        // Shared: "m\0system\0", the document, "\0user\0" (1,175 bytes): 18 whole blocks.
        assert_eq!(shared, (doc.len() + 15) / BLOCK_BYTES);
        assert!(a.tokens >= doc.len() as u64 / BYTES_PER_TOKEN);
        // Another model is another cache.
        let other =
            prompt_blocks(&json!({"model": "n", "messages": [{"role": "system", "content": doc}]}), 4096)
                .expect("a prompt");
        assert_ne!(other.blocks[0], a.blocks[0]);
        // Text parts count like a string; a completion prompt too.
        let parts = json!({"model": "m", "messages": [{"role": "system", "content": [{"type": "text", "text": doc}]},
            {"role": "user", "content": "first question"}]});
        assert_eq!(prompt_blocks(&parts, 4096), Some(a));
        assert!(prompt_blocks(&json!({"model": "m", "prompt": doc}), 4096).is_some());
    }

    #[test]
    fn a_cut_body_hashes_its_bytes_and_two_cuts_share_their_common_run() {
        let doc = "a long shared system prompt. ".repeat(40);
        let whole = serde_json::to_vec(&chat(&doc, "first question")).expect("json");
        // A whole body reads as its prompt.
        assert_eq!(body_blocks(&whole, 4096), prompt_blocks(&chat(&doc, "first question"), 4096));
        // Two bodies cut at different points, as a load balancer's buffer cuts them.
        let other = serde_json::to_vec(&chat(&doc, "another question")).expect("json");
        let a = body_blocks(&whole[..900], 4096).expect("bytes");
        let b = body_blocks(&other[..1000], 4096).expect("bytes");
        assert_eq!(a.blocks.len(), 900 / BLOCK_BYTES);
        assert_eq!(a.tokens, 900u64.div_ceil(BYTES_PER_TOKEN));
        assert_eq!(a.blocks[..], b.blocks[..a.blocks.len()], "the shared opening gives the same blocks");
        assert_eq!(body_blocks(b"", 4096), None);
        assert_eq!(body_blocks(br#"{"model":"m"}"#, 4096), None);
    }

    #[test]
    fn no_prompt_is_none_and_a_huge_one_hashes_only_its_leading_blocks() {
        assert_eq!(prompt_blocks(&json!({"model": "m"}), 64), None);
        assert_eq!(prompt_blocks(&json!({"model": "m", "messages": 3}), 64), None);
        let huge = "x".repeat(10 << 20);
        let p = prompt_blocks(&json!({"model": "m", "prompt": huge}), 64).expect("a prompt");
        assert_eq!(p.blocks.len(), 64);
        assert_eq!(p.tokens, (2 + (10u64 << 20)).div_ceil(BYTES_PER_TOKEN));
    }
}
