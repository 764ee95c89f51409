//! `server.api_keys_file` as `carpool.runtime.api.keys.KeyFile` reads it: one key per line, blank lines and
//! `#` comments skipped, re-read at most once a second when its identity (device, inode, size, mtime)
//! changes, only SHA-256 digests held, every digest compared. This front only ever says yes: a request it
//! cannot accept goes to a Python front, which refuses it (401) and counts the refusal.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::Mutex;

use sha2::{Digest, Sha256};

use crate::engine::monotonic;

type Identity = (u64, u64, u64, i64, i64);

struct State {
    digests: Vec<[u8; 32]>,
    identity: Option<Identity>,
    checked: f64,
}

pub struct KeyFile {
    path: PathBuf,
    state: Mutex<State>,
}

fn identity(path: &PathBuf) -> Option<Identity> {
    let meta = std::fs::metadata(path).ok()?;
    Some((
        meta.dev(),
        meta.ino(),
        meta.size(),
        meta.mtime(),
        meta.mtime_nsec(),
    ))
}

fn digests(text: &str) -> Vec<[u8; 32]> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|key| Sha256::digest(key.as_bytes()).into())
        .collect()
}

impl KeyFile {
    pub fn new(path: PathBuf) -> KeyFile {
        let identity = identity(&path);
        let digests = std::fs::read_to_string(&path)
            .map(|text| digests(&text))
            .unwrap_or_default();
        KeyFile {
            path,
            state: Mutex::new(State {
                digests,
                identity,
                checked: monotonic(),
            }),
        }
    }

    /// True when `authorization` (the header's value) is `Bearer <one of the keys>`.
    pub fn accepts(&self, authorization: Option<&[u8]>) -> bool {
        let Some(token) = authorization.and_then(bearer) else {
            return false;
        };
        let presented: [u8; 32] = Sha256::digest(token).into();
        let mut state = self.state.lock().unwrap();
        let now = monotonic();
        if now - state.checked >= 1.0 {
            state.checked = now;
            let current = identity(&self.path);
            if current.is_some() && current != state.identity {
                if let Ok(text) = std::fs::read_to_string(&self.path) {
                    state.digests = digests(&text);
                    state.identity = current;
                }
            }
        }
        let mut matched = 0u8;
        for digest in &state.digests {
            let mut differ = 0u8;
            for (a, b) in digest.iter().zip(presented.iter()) {
                differ |= a ^ b;
            }
            matched |= (differ == 0) as u8;
        }
        matched == 1
    }
}

/// The token of `Bearer <token>` (scheme in any case), as `api.auth.bearer_token`.
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let value = std::str::from_utf8(value).ok()?.trim();
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token.as_bytes())
}
