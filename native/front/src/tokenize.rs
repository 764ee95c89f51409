//! Text -> token ids exactly as the Python fronts' `TextCodec.encode_batch` gives them: the engine's
//! tokenizer (`TextSpec.tokenizer_json`) without truncation or padding, with the model's special tokens;
//! for a BERT-normalized tokenizer and an ASCII text, the normalizer's work done on the bytes and the
//! tokenizer run without it (`api.text.AsciiPath`: the same ids, without `tokenizers`' per-character
//! alignment bookkeeping).

use std::str::FromStr;

use tokenizers::Tokenizer;

pub struct Codec {
    tokenizer: Tokenizer,
    ascii: Option<AsciiPath>,
}

struct AsciiPath {
    tokenizer: Tokenizer,
    /// BERT's pre-tokenizer and WordPiece on folded ASCII, without `tokenizers`' bookkeeping (offsets,
    /// token strings, alignments): where the tokenizer is that and nothing else, checked at start-up
    /// against `tokenizer` on probe texts.
    wordpiece: Option<WordPiece>,
    clean_text: bool,
    lowercase: bool,
    /// Added tokens' texts, lowercased: a text holding one (in any case) takes the tokenizer's own path.
    added: Vec<String>,
}

fn plain(json: &str) -> Result<Tokenizer, String> {
    let mut tokenizer = Tokenizer::from_str(json).map_err(|e| e.to_string())?;
    tokenizer.with_truncation(None).map_err(|e| e.to_string())?;
    tokenizer.with_padding(None);
    Ok(tokenizer)
}

impl Codec {
    pub fn new(json: &str) -> Result<Codec, String> {
        let tokenizer = plain(json)?;
        let mut config: serde_json::Value =
            serde_json::from_str(json).map_err(|e| e.to_string())?;
        let normalizer = config.get("normalizer").cloned().unwrap_or_default();
        let ascii = if normalizer.get("type").and_then(|t| t.as_str()) == Some("BertNormalizer") {
            let flag = |name: &str| {
                normalizer
                    .get(name)
                    .and_then(|v| v.as_bool())
                    .unwrap_or(false)
            };
            let (clean_text, lowercase) = (flag("clean_text"), flag("lowercase"));
            let added = config
                .get("added_tokens")
                .and_then(|list| list.as_array())
                .map(|list| {
                    list.iter()
                        .filter_map(|token| token.get("content").and_then(|c| c.as_str()))
                        .filter(|content| !content.is_empty())
                        .map(str::to_lowercase)
                        .collect()
                })
                .unwrap_or_default();
            config["normalizer"] = serde_json::Value::Null;
            let tokenizer = plain(&config.to_string())?;
            let wordpiece =
                WordPiece::of(&config, &tokenizer).filter(|wordpiece| wordpiece.agrees(&tokenizer));
            Some(AsciiPath {
                tokenizer,
                wordpiece,
                clean_text,
                lowercase,
                added,
            })
        } else {
            None
        };
        Ok(Codec { tokenizer, ascii })
    }

    /// The ids of `text` with the special tokens (`tokenizer(text, add_special_tokens=True)`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        if let Some(ascii) = &self.ascii {
            if let Some(folded) = ascii.fold(text) {
                if let Some(wordpiece) = &ascii.wordpiece {
                    return Ok(wordpiece.encode(&folded));
                }
                let encoding = ascii
                    .tokenizer
                    .encode_fast(folded, true)
                    .map_err(|e| e.to_string())?;
                return Ok(encoding.get_ids().to_vec());
            }
        }
        let encoding = self
            .tokenizer
            .encode_fast(text, true)
            .map_err(|e| e.to_string())?;
        Ok(encoding.get_ids().to_vec())
    }
}

impl AsciiPath {
    /// `BertNormalizer` on an ASCII text; None where the tokenizer's own path must take it.
    fn fold(&self, text: &str) -> Option<String> {
        if !text.is_ascii() {
            return None;
        }
        let mut folded = String::with_capacity(text.len());
        for byte in text.bytes() {
            let mut c = byte;
            if self.lowercase {
                c = c.to_ascii_lowercase();
            }
            if self.clean_text {
                match c {
                    b'\t' | b'\n' | b'\r' => c = b' ',
                    0x00..=0x1f | 0x7f => continue,
                    _ => {}
                }
            }
            folded.push(c as char);
        }
        if !self.added.is_empty() {
            let lowered = text.to_ascii_lowercase();
            let folded_lower = folded.to_ascii_lowercase();
            if self.added.iter().any(|token| {
                lowered.contains(token.as_str()) || folded_lower.contains(token.as_str())
            }) {
                return None;
            }
        }
        Some(folded)
    }
}

/// `BertPreTokenizer` then `WordPiece` then the post-processor's special tokens, on a folded ASCII text.
struct WordPiece {
    vocab: std::collections::HashMap<String, u32>,
    unk: u32,
    prefix: String,
    max_chars: usize,
    head: Vec<u32>,
    tail: Vec<u32>,
}

/// Texts whose ids the native path must give exactly as `tokenizers` does before it is used.
const PROBES: &[&str] = &[
    "requests share a ride.",
    "the runtime groups them into batches, so a gpu does in one pass what would take many!",
    "unaffable hyper-parameters: 3.14159, 1e-5 & 42%... (really?) [cls] ##ing #hash @user",
    "a  b\tc\nd  ",
    "supercalifragilisticexpialidociousxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx end",
    "zzzzqqqq xylophonist's naïve",
    "~`!@#$%^&*()_+-={}|[]\\:\";'<>?,./ 0123456789",
    "",
    " ",
];

impl WordPiece {
    fn of(config: &serde_json::Value, tokenizer: &Tokenizer) -> Option<WordPiece> {
        if config.get("pre_tokenizer")?.get("type")?.as_str()? != "BertPreTokenizer" {
            return None;
        }
        let model = config.get("model")?;
        if model.get("type")?.as_str()? != "WordPiece" {
            return None;
        }
        let vocab = tokenizer.get_vocab(false);
        let unk = *vocab.get(model.get("unk_token")?.as_str()?)?;
        let prefix = model.get("continuing_subword_prefix")?.as_str()?.to_owned();
        let max_chars = model.get("max_input_chars_per_word")?.as_u64()? as usize;
        let special = |name: &str| -> Option<u32> { tokenizer.token_to_id(name) };
        let (head, tail) = match config.get("post_processor") {
            None | Some(serde_json::Value::Null) => (vec![], vec![]),
            Some(processor) => match processor.get("type")?.as_str()? {
                "BertProcessing" => (
                    vec![processor.get("cls")?.get(1)?.as_u64()? as u32],
                    vec![processor.get("sep")?.get(1)?.as_u64()? as u32],
                ),
                "TemplateProcessing" => {
                    let (mut head, mut tail, mut seen) = (vec![], vec![], false);
                    for piece in processor.get("single")?.as_array()? {
                        if piece.get("Sequence").is_some() {
                            seen = true;
                        } else {
                            let name = piece.get("SpecialToken")?.get("id")?.as_str()?;
                            let ids: Vec<u32> =
                                match processor.get("special_tokens").and_then(|t| t.get(name)) {
                                    Some(token) => token
                                        .get("ids")?
                                        .as_array()?
                                        .iter()
                                        .map(|id| id.as_u64().map(|id| id as u32))
                                        .collect::<Option<_>>()?,
                                    None => vec![special(name)?],
                                };
                            if seen {
                                tail.extend(ids)
                            } else {
                                head.extend(ids)
                            }
                        }
                    }
                    (head, tail)
                }
                _ => return None,
            },
        };
        Some(WordPiece {
            vocab,
            unk,
            prefix,
            max_chars,
            head,
            tail,
        })
    }

    fn agrees(&self, tokenizer: &Tokenizer) -> bool {
        PROBES.iter().filter(|probe| probe.is_ascii()).all(|probe| {
            tokenizer
                .encode_fast(*probe, true)
                .map(|e| e.get_ids().to_vec())
                .ok()
                == Some(self.encode(probe))
        })
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::with_capacity(self.head.len() + self.tail.len() + text.len() / 3);
        ids.extend_from_slice(&self.head);
        let mut word_start: Option<usize> = None;
        for (index, c) in text.char_indices() {
            let space = c.is_whitespace();
            let punctuation = c.is_ascii_punctuation();
            if space || punctuation {
                if let Some(start) = word_start.take() {
                    self.word(&text[start..index], &mut ids);
                }
                if punctuation {
                    self.word(&text[index..index + 1], &mut ids);
                }
            } else if word_start.is_none() {
                word_start = Some(index);
            }
        }
        if let Some(start) = word_start {
            self.word(&text[start..], &mut ids);
        }
        ids.extend_from_slice(&self.tail);
        ids
    }

    /// WordPiece's greedy longest match from the left; a word with a piece not in the vocabulary, or
    /// longer than `max_input_chars_per_word`, is the unknown token.
    fn word(&self, word: &str, ids: &mut Vec<u32>) {
        if word.len() > self.max_chars {
            ids.push(self.unk);
            return;
        }
        let before = ids.len();
        let mut piece = String::with_capacity(word.len() + self.prefix.len());
        let mut start = 0;
        while start < word.len() {
            let mut end = word.len();
            let mut found = None;
            while start < end {
                piece.clear();
                if start > 0 {
                    piece.push_str(&self.prefix);
                }
                piece.push_str(&word[start..end]);
                if let Some(&id) = self.vocab.get(piece.as_str()) {
                    found = Some(id);
                    break;
                }
                end -= 1;
            }
            match found {
                Some(id) => ids.push(id),
                None => {
                    ids.truncate(before);
                    ids.push(self.unk);
                    return;
                }
            }
            start = end;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The embedded default model's tokenizer (MiniLM, BERT WordPiece), where the environment has it.
    fn minilm() -> Option<String> {
        let path = std::env::var("CARPOOL_TEST_TOKENIZER").ok()?;
        std::fs::read_to_string(path).ok()
    }

    #[test]
    fn the_native_wordpiece_gives_the_tokenizers_ids() {
        let Some(json) = minilm() else {
            panic!("set CARPOOL_TEST_TOKENIZER to a BERT tokenizer.json (make native-test does)");
        };
        let codec = Codec::new(&json).unwrap();
        let ascii = codec
            .ascii
            .as_ref()
            .expect("a BertNormalizer tokenizer takes the ASCII path");
        assert!(
            ascii.wordpiece.is_some(),
            "MiniLM's tokenizer takes the native WordPiece"
        );
        // random ASCII texts, words of letters, digits, punctuation and whitespace of every kind
        let alphabet: Vec<char> = (0u8..128).map(char::from).collect();
        let mut state = 0x2545f4914f6cdd1d_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let words = [
            "the",
            "runtime",
            "unaffable",
            "batching",
            "GPU",
            "naive",
            "x",
            "Zzyzx",
            "embeddings",
        ];
        for round in 0..3000 {
            let mut text = String::new();
            for _ in 0..(next() % 40) {
                match next() % 4 {
                    0 => text.push(alphabet[(next() % 128) as usize]),
                    1 => text.push(' '),
                    _ => text.push_str(words[(next() % words.len() as u64) as usize]),
                }
            }
            if round % 97 == 0 {
                text.push_str(&"a".repeat(101 + round % 3));
            }
            let expected = codec
                .tokenizer
                .encode_fast(text.as_str(), true)
                .unwrap()
                .get_ids()
                .to_vec();
            assert_eq!(codec.encode(&text).unwrap(), expected, "text {text:?}");
        }
    }
}
