//! Token counts without a tokenizer, and the text the simulator "generates".
//!
//! Prompt length: one token per 4 characters (Unicode scalar values), rounded up — the usual rule
//! of thumb for English with BPE tokenizers such as Llama 3's (OpenAI documents "~4 characters per
//! token"). Chat prompts add the Llama 3 chat template's overhead: 1 token for
//! `<|begin_of_text|>`, 5 per message for `<|start_header_id|>role<|end_header_id|>\n\n ...
//! <|eot_id|>`, and 4 for the assistant header that primes the answer.
//!
//! Output text: token `i` of an answer is a short word from a fixed list, so answers are
//! deterministic and every streamed chunk carries exactly one token.

/// Tokens of a plain text prompt: `ceil(chars / 4)`.
pub fn text_tokens(text: &str) -> u32 {
    let chars = text.chars().count() as u64;
    u32::try_from(chars.div_ceil(4)).unwrap_or(u32::MAX)
}

/// Fixed chat-template tokens around `messages` messages (see the module doc).
pub fn chat_template_tokens(messages: usize) -> u32 {
    let per_message = u32::try_from(messages).unwrap_or(u32::MAX / 8).saturating_mul(5);
    per_message.saturating_add(1 + 4)
}

const WORDS: &[&str] = &[
    " the",
    " model",
    " is",
    " simulated",
    " and",
    " each",
    " word",
    " is",
    " one",
    " token",
    ".",
    " Load",
    " balancers",
    " see",
    " queues",
    " grow",
    " when",
    " a",
    " replica",
    " slows",
    ",",
    " so",
    " ratios",
    " move",
    " traffic",
    " away",
    ".",
];

/// Text of the `i`-th output token (0-based).
pub fn output_piece(i: u32) -> &'static str {
    WORDS[i as usize % WORDS.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_chars_per_token_rounded_up() {
        assert_eq!(text_tokens(""), 0);
        assert_eq!(text_tokens("a"), 1);
        assert_eq!(text_tokens("abcd"), 1);
        assert_eq!(text_tokens("abcde"), 2);
        assert_eq!(text_tokens("ééééé"), 2, "characters, not bytes");
    }

    #[test]
    fn chat_overhead_follows_the_llama3_template() {
        assert_eq!(chat_template_tokens(0), 5);
        assert_eq!(chat_template_tokens(2), 15);
    }

    #[test]
    fn output_is_deterministic() {
        assert_eq!(output_piece(0), " the");
        assert_eq!(output_piece(WORDS.len() as u32), " the");
    }
}
