//! The messages between a front and the engine processes, as `carpool.runtime.wire` defines them:
//! msgspec structs encoded as MessagePack arrays (`array_like`), a tagged struct's tag first, every frame
//! a list of messages. Only what this front sends and reads: `EncodeRequest`, `Abort`, `Goodbye` out;
//! `Status`, `EncodeOutput` ("rows") and `ErrorOutput` in (the rest is skipped).

use rmpv::Value;

/// An encoder request (`wire.EncodeRequest`): one id list per input.
pub struct EncodeRequest {
    pub rid: u64,
    pub front: u32,
    pub tokens: Vec<Vec<u32>>,
    pub priority: i64,
    pub arrival: f64,
    pub deadline: f64,
}

pub enum FrontMessage {
    Encode(EncodeRequest),
    Abort(Vec<u64>),
    Goodbye(u32),
}

/// The frame of `messages` (a MessagePack array of them).
pub fn encode(messages: &[FrontMessage]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + messages.len() * 256);
    rmp::encode::write_array_len(&mut out, messages.len() as u32).unwrap();
    for message in messages {
        match message {
            FrontMessage::Encode(r) => {
                rmp::encode::write_array_len(&mut out, 7).unwrap();
                rmp::encode::write_str(&mut out, "encode").unwrap();
                rmp::encode::write_uint(&mut out, r.rid).unwrap();
                rmp::encode::write_uint(&mut out, r.front as u64).unwrap();
                rmp::encode::write_array_len(&mut out, r.tokens.len() as u32).unwrap();
                for ids in &r.tokens {
                    rmp::encode::write_array_len(&mut out, ids.len() as u32).unwrap();
                    for &id in ids {
                        rmp::encode::write_uint(&mut out, id as u64).unwrap();
                    }
                }
                rmp::encode::write_sint(&mut out, r.priority).unwrap();
                rmp::encode::write_f64(&mut out, r.arrival).unwrap();
                rmp::encode::write_f64(&mut out, r.deadline).unwrap();
            }
            FrontMessage::Abort(rids) => {
                rmp::encode::write_array_len(&mut out, 2).unwrap();
                rmp::encode::write_str(&mut out, "abort").unwrap();
                rmp::encode::write_array_len(&mut out, rids.len() as u32).unwrap();
                for &rid in rids {
                    rmp::encode::write_uint(&mut out, rid).unwrap();
                }
            }
            FrontMessage::Goodbye(front) => {
                rmp::encode::write_array_len(&mut out, 2).unwrap();
                rmp::encode::write_str(&mut out, "goodbye").unwrap();
                rmp::encode::write_uint(&mut out, *front as u64).unwrap();
            }
        }
    }
    out
}

/// What an engine's status says that this front uses.
#[derive(Clone, Debug, Default)]
pub struct Status {
    pub state: String,
    pub pid: i32,
    pub engine: usize,
    pub info: Option<Info>,
    pub tokenizer_json: Option<String>,
    pub failure: Option<String>,
}

#[derive(Clone, Debug, Default)]
pub struct Info {
    pub name: String,
    pub task: String,
    pub max_input_tokens: usize,
    pub dimensions: Option<usize>,
}

pub enum EngineMessage {
    Status(Status),
    Rows {
        rid: u64,
        dtype: String,
        shape: (usize, usize),
        data: Vec<u8>,
    },
    Error {
        rid: u64,
        kind: String,
        message: String,
        retry_after: Option<f64>,
    },
    Other,
}

fn text(value: &Value) -> Option<String> {
    value.as_str().map(str::to_owned)
}

fn field<'a>(map: &'a Value, name: &str) -> Option<&'a Value> {
    map.as_map()?
        .iter()
        .find(|(key, _)| key.as_str() == Some(name))
        .map(|(_, value)| value)
}

fn info(value: &Value) -> Option<Info> {
    if value.is_nil() {
        return None;
    }
    Some(Info {
        name: field(value, "name").and_then(text)?,
        task: field(value, "task").and_then(text)?,
        max_input_tokens: field(value, "max_input_tokens").and_then(Value::as_u64)? as usize,
        dimensions: field(value, "dimensions")
            .and_then(Value::as_u64)
            .map(|d| d as usize),
    })
}

fn status(items: &[Value]) -> Option<Status> {
    // ["status", state, pid, info, text, failure, adapters, engine, step_age_s]
    let get = |index: usize| items.get(index).unwrap_or(&Value::Nil);
    Some(Status {
        state: text(get(1))?,
        pid: get(2).as_i64().unwrap_or(0) as i32,
        info: info(get(3)),
        tokenizer_json: if get(4).is_nil() {
            None
        } else {
            field(get(4), "tokenizer_json").and_then(text)
        },
        failure: text(get(5)),
        engine: get(7).as_u64().unwrap_or(0) as usize,
    })
}

/// The messages of one frame from an engine.
pub fn decode(frame: &[u8]) -> Result<Vec<EngineMessage>, String> {
    let value =
        rmpv::decode::read_value(&mut &frame[..]).map_err(|e| format!("undecodable frame: {e}"))?;
    let list = value.as_array().ok_or("a frame is a list of messages")?;
    let mut messages = Vec::with_capacity(list.len());
    for item in list {
        let Some(items) = item.as_array() else {
            messages.push(EngineMessage::Other);
            continue;
        };
        let message = match items.first().and_then(Value::as_str) {
            Some("status") => status(items).map(EngineMessage::Status),
            Some("rows") => (|| {
                let shape = items.get(3)?.as_array()?;
                Some(EngineMessage::Rows {
                    rid: items.get(1)?.as_u64()?,
                    dtype: text(items.get(2)?)?,
                    shape: (
                        shape.first()?.as_u64()? as usize,
                        shape.get(1)?.as_u64()? as usize,
                    ),
                    data: match items.get(4)? {
                        Value::Binary(bytes) => bytes.clone(),
                        _ => return None,
                    },
                })
            })(),
            Some("error") => (|| {
                Some(EngineMessage::Error {
                    rid: items.get(1)?.as_u64()?,
                    kind: text(items.get(2)?)?,
                    message: text(items.get(3)?)?,
                    retry_after: items.get(4).and_then(Value::as_f64),
                })
            })(),
            _ => Some(EngineMessage::Other),
        };
        messages.push(message.ok_or_else(|| format!("malformed {:?} message", items.first()))?);
    }
    Ok(messages)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_encode_request_is_a_tagged_array() {
        let frame = encode(&[FrontMessage::Encode(EncodeRequest {
            rid: 7,
            front: 2,
            tokens: vec![vec![101, 102]],
            priority: 1,
            arrival: 1.5,
            deadline: 31.5,
        })]);
        let value = rmpv::decode::read_value(&mut &frame[..]).unwrap();
        let message = &value.as_array().unwrap()[0];
        assert_eq!(message[0].as_str(), Some("encode"));
        assert_eq!(message[1].as_u64(), Some(7));
        assert_eq!(message[3][0][1].as_u64(), Some(102));
        assert_eq!(message[6].as_f64(), Some(31.5));
    }
}
