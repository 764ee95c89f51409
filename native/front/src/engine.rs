//! This front's connection to the engine processes (`carpool.runtime.api.client.EngineClient`'s work for
//! encoder requests): one PUSH socket into each engine's input, one PULL socket bound at this front's
//! output, the engines' statuses combined as the Python fronts combine them, and the requests in flight.
//!
//! Messages for an engine go through a channel to one task per engine, which sends whatever has queued
//! while its previous send ran as one frame: under load one frame carries many requests, and the engine
//! decodes them in one call.

use std::collections::HashMap;
use std::os::fd::FromRawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::tokenize::Codec;
use crate::wire::{self, EncodeRequest, EngineMessage, FrontMessage, Info, Status};

/// `api.client.MAX_FRONTS`: request ids are `n * MAX_FRONTS + front`, unique across one engine's fronts.
pub const MAX_FRONTS: u64 = 4096;

/// How a request ended in the engine.
pub enum Outcome {
    Rows {
        dtype: String,
        shape: (usize, usize),
        data: Vec<u8>,
    },
    Error {
        kind: String,
        message: String,
        retry_after: Option<f64>,
    },
}

struct Pending {
    engine: usize,
    inputs: usize,
    reply: oneshot::Sender<Outcome>,
}

#[derive(Default)]
struct View {
    statuses: Vec<Option<Status>>,
    heard: Vec<f64>,
    dead: Option<String>,
}

/// What the native path needs to know to serve a request, or None where it must not.
#[derive(Clone)]
pub struct Serving {
    pub info: Info,
    pub codec: Arc<Codec>,
}

pub struct Engines {
    pub front: u32,
    outboxes: Vec<mpsc::UnboundedSender<FrontMessage>>,
    pending: Mutex<HashMap<u64, Pending>>,
    outstanding: Vec<AtomicUsize>,
    turn: AtomicUsize,
    ids: AtomicU64,
    view: RwLock<View>,
    codec: RwLock<Option<(String, Arc<Codec>)>>,
    serving: watch::Sender<Option<Serving>>,
    heartbeat_timeout_s: f64,
}

pub fn monotonic() -> f64 {
    // Python's time.monotonic(): CLOCK_MONOTONIC, one clock for every process of the host.
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn order(state: &str) -> u8 {
    match state {
        "loading" => 0,
        "warming" => 1,
        "ready" => 2,
        "draining" => 3,
        _ => 4,
    }
}

/// `api.client.combined`: a failed status if any, else the one furthest behind; None until every engine
/// process has spoken.
fn combined(statuses: &[Option<Status>]) -> Option<&Status> {
    if let Some(failed) = statuses.iter().flatten().find(|s| s.state == "failed") {
        return Some(failed);
    }
    if statuses.iter().any(Option::is_none) {
        return None;
    }
    statuses.iter().flatten().min_by_key(|s| order(&s.state))
}

impl Engines {
    /// Connects to `inputs` (one per engine process) and binds `output`; spawns the socket tasks.
    pub async fn start(
        inputs: &[String],
        output: &str,
        front: u32,
        heartbeat_timeout_s: f64,
    ) -> Result<Arc<Engines>, String> {
        let mut outboxes = Vec::new();
        let mut receivers = Vec::new();
        for _ in inputs {
            let (tx, rx) = mpsc::unbounded_channel();
            outboxes.push(tx);
            receivers.push(rx);
        }
        let count = inputs.len();
        let (serving, _) = watch::channel(None);
        let engines = Arc::new(Engines {
            front,
            outboxes,
            pending: Mutex::new(HashMap::new()),
            outstanding: (0..count).map(|_| AtomicUsize::new(0)).collect(),
            turn: AtomicUsize::new(0),
            ids: AtomicU64::new(1),
            view: RwLock::new(View {
                statuses: vec![None; count],
                heard: vec![monotonic(); count],
                dead: None,
            }),
            codec: RwLock::new(None),
            serving,
            heartbeat_timeout_s,
        });
        let mut pull = zeromq::PullSocket::new();
        pull.bind(output)
            .await
            .map_err(|e| format!("cannot bind {output}: {e}"))?;
        for (address, rx) in inputs.iter().zip(receivers) {
            tokio::spawn(engines.clone().send_loop(address.clone(), rx));
        }
        tokio::spawn(engines.clone().receive_loop(pull));
        tokio::spawn(engines.clone().watch_heartbeats());
        Ok(engines)
    }

    /// The model as served now, when every engine process is ready (or draining: it serves until every
    /// front has said goodbye); None otherwise.
    pub fn serving(&self) -> Option<Serving> {
        self.serving.borrow().clone()
    }

    pub fn next_rid(&self) -> u64 {
        self.ids.fetch_add(1, Ordering::Relaxed) * MAX_FRONTS + self.front as u64
    }

    /// Sends `request` to the engine process with the fewest of this front's inputs outstanding (ties
    /// in turn) and returns where its outcome will come.
    pub fn encode(&self, request: EncodeRequest) -> Result<oneshot::Receiver<Outcome>, String> {
        if let Some(dead) = &self.view.read().unwrap().dead {
            return Err(dead.clone());
        }
        let inputs = request.tokens.len();
        let count = self.outboxes.len();
        let engine = if count == 1 {
            0
        } else {
            let turn = self.turn.fetch_add(1, Ordering::Relaxed);
            (0..count)
                .min_by_key(|&k| {
                    (
                        self.outstanding[k].load(Ordering::Relaxed),
                        (k + count - turn % count) % count,
                    )
                })
                .unwrap_or(0)
        };
        let (tx, rx) = oneshot::channel();
        self.outstanding[engine].fetch_add(inputs, Ordering::Relaxed);
        self.pending.lock().unwrap().insert(
            request.rid,
            Pending {
                engine,
                inputs,
                reply: tx,
            },
        );
        if self.outboxes[engine]
            .send(FrontMessage::Encode(request))
            .is_err()
        {
            return Err("the engine socket is closed".into());
        }
        Ok(rx)
    }

    /// The caller went away: withdraw the request (sent after it, so never ahead of it).
    pub fn abort(&self, rid: u64) {
        if let Some(pending) = self.finish(rid) {
            let _ = self.outboxes[pending.engine].send(FrontMessage::Abort(vec![rid]));
        }
    }

    fn finish(&self, rid: u64) -> Option<Pending> {
        let pending = self.pending.lock().unwrap().remove(&rid)?;
        self.outstanding[pending.engine].fetch_sub(pending.inputs, Ordering::Relaxed);
        Some(pending)
    }

    /// This front has answered all it accepted and sends nothing more (the engines stop once every front
    /// has said so).
    pub fn goodbye(&self) {
        for outbox in &self.outboxes {
            let _ = outbox.send(FrontMessage::Goodbye(self.front));
        }
    }

    /// Sends what is queued for one engine process, as one frame per send: whatever queued while the
    /// previous send ran goes together, and the engine decodes it in one call.
    async fn send_loop(
        self: Arc<Self>,
        address: String,
        mut rx: mpsc::UnboundedReceiver<FrontMessage>,
    ) {
        // The engine binds its input once it has imported its libraries: until then (libzmq retries a
        // connect by itself) try again every 50 ms; what is sent meanwhile waits in the channel.
        let mut push = loop {
            let mut push = zeromq::PushSocket::new();
            match push.connect(&address).await {
                Ok(()) => break push,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        let mut batch = Vec::new();
        while let Some(first) = rx.recv().await {
            batch.push(first);
            // Let the requests whose bytes came in the same turn of the reactor (other connections' tasks,
            // ready behind this one) be read and tokenized first, so they go in this frame; with nothing
            // else ready this returns at once.
            tokio::task::yield_now().await;
            while let Ok(more) = rx.try_recv() {
                batch.push(more);
            }
            let sent: Vec<u64> = batch
                .iter()
                .filter_map(|m| {
                    if let FrontMessage::Encode(r) = m {
                        Some(r.rid)
                    } else {
                        None
                    }
                })
                .collect();
            let frame = wire::encode(&batch);
            batch.clear();
            if let Err(error) = push.send(ZmqMessage::from(frame)).await {
                let message = format!("could not reach the model engine ({error}); retry");
                for rid in sent {
                    self.fail(rid, "NotReady", &message, Some(1.0));
                }
            }
        }
    }

    fn fail(&self, rid: u64, kind: &str, message: &str, retry_after: Option<f64>) {
        if let Some(pending) = self.finish(rid) {
            let _ = pending.reply.send(Outcome::Error {
                kind: kind.into(),
                message: message.into(),
                retry_after,
            });
        }
    }

    async fn receive_loop(self: Arc<Self>, mut pull: zeromq::PullSocket) {
        loop {
            let message = match pull.recv().await {
                Ok(message) => message,
                Err(error) => {
                    self.die(&format!("this front's engine socket failed: {error}"));
                    return;
                }
            };
            let heard = monotonic();
            for frame in message.iter() {
                let decoded = match wire::decode(frame) {
                    Ok(decoded) => decoded,
                    Err(error) => {
                        crate::logs::log("error", &error);
                        continue;
                    }
                };
                for item in decoded {
                    match item {
                        EngineMessage::Status(status) => self.on_status(status, heard),
                        EngineMessage::Rows {
                            rid,
                            dtype,
                            shape,
                            data,
                        } => {
                            if let Some(pending) = self.finish(rid) {
                                let _ = pending.reply.send(Outcome::Rows { dtype, shape, data });
                            }
                        }
                        EngineMessage::Error {
                            rid,
                            kind,
                            message,
                            retry_after,
                        } => self.fail(rid, &kind, &message, retry_after),
                        EngineMessage::Other => {}
                    }
                }
            }
        }
    }

    fn on_status(self: &Arc<Self>, mut status: Status, heard: f64) {
        if let Some(json) = status.tokenizer_json.take() {
            let mut codec = self.codec.write().unwrap();
            if codec
                .as_ref()
                .map(|(known, _)| known != &json)
                .unwrap_or(true)
            {
                match Codec::new(&json) {
                    Ok(built) => *codec = Some((json, Arc::new(built))),
                    Err(error) => crate::logs::log(
                        "error",
                        &format!("the engine's tokenizer does not load: {error}"),
                    ),
                }
            }
        }
        let mut view = self.view.write().unwrap();
        let engine = status.engine.min(view.statuses.len() - 1);
        view.heard[engine] = heard;
        let failed = (status.state == "failed").then(|| {
            status
                .failure
                .clone()
                .unwrap_or_else(|| "the engine failed".into())
        });
        let first = view.statuses[engine].as_ref().map(|known| known.pid) != Some(status.pid);
        let pid = status.pid;
        view.statuses[engine] = Some(status);
        self.publish(&view);
        drop(view);
        if first && pid > 0 {
            self.watch_process(pid, engine);
        }
        if let Some(reason) = failed {
            self.die(&reason);
        }
    }

    /// Fails what waits on the engine as soon as engine process `pid` exits (a pidfd, as the Python
    /// fronts watch it), not a heartbeat timeout later; one that drained and stopped is not a loss.
    fn watch_process(self: &Arc<Self>, pid: i32, engine: usize) {
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as i32;
        if fd < 0 {
            return; // gone already, or no pidfd: the heartbeat still tells
        }
        let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        // SAFETY: the pidfd is owned by `watched` alone and stays open while registered.
        let Ok(watched) = (unsafe { tokio::io::unix::AsyncFd::register(owned) }) else {
            return;
        };
        let engines = Arc::clone(self);
        tokio::spawn(async move {
            let _ = watched.readable().await;
            let stopped = {
                let view = engines.view.read().unwrap();
                let mine = view.statuses[engine]
                    .as_ref()
                    .map(|s| s.state == "stopped")
                    .unwrap_or(false);
                let all = combined(&view.statuses)
                    .map(|s| s.state == "stopped")
                    .unwrap_or(false);
                mine && !all
            };
            if !stopped {
                engines.die(&format!("the engine process {pid} exited"));
            }
        });
    }

    fn publish(&self, view: &View) {
        let codec = self
            .codec
            .read()
            .unwrap()
            .as_ref()
            .map(|(_, codec)| codec.clone());
        let serving = match (combined(&view.statuses), codec, &view.dead) {
            // A draining engine serves until every front has said goodbye: whether a request is still
            // taken is this front's drain to decide (`Frontend._require_ready`), as it is a Python front's.
            (Some(status), Some(codec), None)
                if status.state == "ready" || status.state == "draining" =>
            {
                status.info.clone().map(|info| Serving { info, codec })
            }
            _ => None,
        };
        self.serving.send_replace(serving);
    }

    fn die(&self, reason: &str) {
        let mut view = self.view.write().unwrap();
        if view.dead.is_none() {
            crate::logs::log(
                "error",
                &format!("engine lost: {reason}; failing every waiting request with 500"),
            );
            view.dead = Some(reason.into());
        }
        self.publish(&view);
        drop(view);
        let waiting: Vec<u64> = self.pending.lock().unwrap().keys().copied().collect();
        let message = format!("the model engine failed while serving this request: {reason}");
        for rid in waiting {
            self.fail(rid, "BatchFailed", &message, None);
        }
    }

    async fn watch_heartbeats(self: Arc<Self>) {
        let period = Duration::from_secs_f64(self.heartbeat_timeout_s / 4.0);
        loop {
            tokio::time::sleep(period).await;
            let now = monotonic();
            let silent = {
                let view = self.view.read().unwrap();
                view.statuses
                    .iter()
                    .zip(&view.heard)
                    .filter(|(status, _)| {
                        status
                            .as_ref()
                            .map(|s| s.state != "stopped")
                            .unwrap_or(false)
                    })
                    .map(|(_, heard)| now - heard)
                    .fold(0.0_f64, f64::max)
            };
            if silent > self.heartbeat_timeout_s {
                self.die(&format!("no word from the engine for {silent:.0}s"));
            }
        }
    }
}
