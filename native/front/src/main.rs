//! `carpool-front`: a native HTTP front for a carpool pod serving an embedding model
//! (`server.native_front`). It owns the API port and answers `POST /v1/embeddings` itself (parse,
//! key check, tokenization, the engine round trip over the engine's own ZeroMQ wire, the OpenAI answer,
//! the request metrics), and passes every other request, and every embeddings request it would not answer
//! exactly as a Python front does, unread or as read, to a Python front over a Unix socket: one upstream
//! connection per client connection, so what the Python fronts do (errors, other routes, streaming, the
//! drain's `Connection: close`) reaches the client unchanged.
//!
//! Started by the supervisor (`carpool.runtime.native`), which passes the listening socket, the Python
//! fronts' sockets and the engines' addresses as one JSON argument.

mod engine;
mod keys;
mod logs;
mod metrics;
mod tokenize;
mod wire;

use std::convert::Infallible;
use std::net::TcpListener as StdListener;
use std::os::fd::FromRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde_json::Value;
use tokio::net::{TcpListener, UnixStream};
use tokio::sync::{watch, Mutex};

use engine::{monotonic, Engines, Outcome, Serving};

type Body = BoxBody<Bytes, hyper::Error>;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Deserialize)]
struct Config {
    listen_fd: i32,
    upstreams: Vec<String>,
    engine_inputs: Vec<String>,
    output: String,
    front: u32,
    model: String,
    #[serde(default)]
    keys_file: Option<String>,
    max_body_bytes: usize,
    items_limit: usize,
    priority_levels: i64,
    default_priority: i64,
    request_timeout_s: f64,
    drain_keep_alive_s: f64,
    drain_timeout_s: f64,
    #[serde(default)]
    metrics_dir: Option<String>,
    #[serde(default = "one")]
    threads: usize,
    #[serde(default = "ten")]
    heartbeat_timeout_s: f64,
    #[serde(default)]
    log_format: String,
    #[serde(default)]
    log_level: String,
}

fn one() -> usize {
    1
}
fn ten() -> f64 {
    10.0
}

struct App {
    config: Config,
    engines: Arc<Engines>,
    keys: Option<keys::KeyFile>,
    metrics: metrics::Metrics,
    /// Requests this front is answering itself.
    inflight: AtomicUsize,
    /// SIGTERM came: new connections go to the Python fronts (which refuse them while draining).
    draining: AtomicBool,
    /// The drain's grace is over: nothing more is answered here.
    closed: AtomicBool,
    next_upstream: AtomicUsize,
}

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

fn main() {
    let raw = std::env::args().nth(1).unwrap_or_default();
    let config: Config = match serde_json::from_str(&raw) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("carpool-front: usage: carpool-front '<config JSON>' ({error})");
            std::process::exit(2);
        }
    };
    logs::configure(&config.log_format, &config.log_level);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.threads.max(1))
        .thread_name("carpool-native")
        .enable_all()
        .build()
        .expect("a tokio runtime");
    std::process::exit(runtime.block_on(serve(config)));
}

async fn serve(config: Config) -> i32 {
    let engines = match Engines::start(
        &config.engine_inputs,
        &config.output,
        config.front,
        config.heartbeat_timeout_s,
    )
    .await
    {
        Ok(engines) => engines,
        Err(error) => {
            logs::log("critical", &error);
            return 1;
        }
    };
    let metrics = match metrics::Metrics::new(
        config.metrics_dir.as_deref().map(std::path::Path::new),
        &config.model,
    ) {
        Ok(metrics) => metrics,
        Err(error) => {
            logs::log("critical", &format!("cannot write metrics: {error}"));
            return 1;
        }
    };
    let keys = config
        .keys_file
        .clone()
        .map(|path| keys::KeyFile::new(path.into()));
    let std_listener = unsafe { StdListener::from_raw_fd(config.listen_fd) };
    std_listener
        .set_nonblocking(true)
        .expect("a non-blocking listener");
    let listener = TcpListener::from_std(std_listener).expect("the listening socket");
    let app = Arc::new(App {
        config,
        engines,
        keys,
        metrics,
        inflight: AtomicUsize::new(0),
        draining: AtomicBool::new(false),
        closed: AtomicBool::new(false),
        next_upstream: AtomicUsize::new(0),
    });
    logs::log(
        "info",
        &format!(
            "native front: POST /v1/embeddings answered here, the rest passed to {} Python front(s), {} thread(s)",
            app.config.upstreams.len(),
            app.config.threads.max(1)
        ),
    );
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let connections = Arc::new(AtomicUsize::new(0));
    let early = Arc::new(AtomicUsize::new(0));
    let mut term =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM");
    let mut int =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).expect("SIGINT");
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let watch = Some((shutdown_rx.clone(), early.clone()));
                tokio::spawn(connection(app.clone(), stream, watch, connections.clone()));
            }
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
    }
    // The drain, as the Python fronts drain (`api.draining`): a connection from before it is served for
    // the grace (`server.drain_keep_alive_s`; a request on it is answered, with `Connection: close`), and
    // one idle after it is closed; a new connection still gets an answer: the Python fronts' 503 while
    // they drain, or this front's once they are gone. This front stops once nothing is open.
    app.draining.store(true, Ordering::SeqCst);
    logs::log(
        "info",
        &format!(
            "draining: {} requests in flight",
            app.inflight.load(Ordering::SeqCst)
        ),
    );
    let started = Instant::now();
    let grace_end = started + Duration::from_secs_f64(app.config.drain_keep_alive_s);
    let bound = Duration::from_secs_f64(app.config.drain_timeout_s);
    loop {
        let early_open = early.load(Ordering::SeqCst);
        if !app.closed.load(Ordering::SeqCst) && (Instant::now() >= grace_end || early_open == 0) {
            app.closed.store(true, Ordering::SeqCst);
            let _ = shutdown_tx.send(true);
        }
        let idle =
            connections.load(Ordering::SeqCst) == 0 && app.inflight.load(Ordering::SeqCst) == 0;
        if (app.closed.load(Ordering::SeqCst) && idle) || started.elapsed() >= bound {
            break;
        }
        tokio::select! {
            accepted = listener.accept() => {
                if let Ok((stream, _)) = accepted {
                    let _ = stream.set_nodelay(true);
                    tokio::spawn(connection(app.clone(), stream, None, connections.clone()));
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
    // Closing a listening socket resets the connections queued on it: first stop new handshakes, then
    // answer what the kernel has queued.
    refuse_new_connections(&listener);
    while let Ok(Ok((stream, _))) =
        tokio::time::timeout(Duration::from_millis(50), listener.accept()).await
    {
        tokio::spawn(connection(app.clone(), stream, None, connections.clone()));
    }
    let last = Instant::now();
    while connections.load(Ordering::SeqCst) > 0 && last.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    app.engines.goodbye();
    tokio::time::sleep(Duration::from_millis(200)).await; // the goodbye's frame leaves before the exit
    logs::log(
        "info",
        &format!("drained in {:.2}s", started.elapsed().as_secs_f64()),
    );
    0
}

/// A socket filter that drops every packet (classic BPF `ret #0`) on the listening socket: no new
/// handshake completes, connections already queued are untouched (`api.draining.refuse_new_connections`).
fn refuse_new_connections(listener: &TcpListener) {
    use std::os::fd::AsRawFd;
    let mut program = [libc::sock_filter {
        code: 0x06,
        jt: 0,
        jf: 0,
        k: 0,
    }];
    let fprog = libc::sock_fprog {
        len: 1,
        filter: program.as_mut_ptr(),
    };
    unsafe {
        libc::setsockopt(
            listener.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_FILTER,
            &fprog as *const libc::sock_fprog as *const libc::c_void,
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        );
    }
}

struct Conn {
    upstream: Mutex<Option<hyper::client::conn::http1::SendRequest<Body>>>,
    /// Accepted before the drain began.
    early: bool,
}

struct Counted(Arc<AtomicUsize>);
impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Serves one client connection. `early`: accepted before the drain, with the drain's signal to close
/// it once idle and the count of such connections; None for one accepted during the drain.
async fn connection(
    app: Arc<App>,
    stream: tokio::net::TcpStream,
    early: Option<(watch::Receiver<bool>, Arc<AtomicUsize>)>,
    connections: Arc<AtomicUsize>,
) {
    connections.fetch_add(1, Ordering::SeqCst);
    let _counted = Counted(connections);
    let conn = Arc::new(Conn {
        upstream: Mutex::new(None),
        early: early.is_some(),
    });
    let service = hyper::service::service_fn(move |request| {
        let (app, conn) = (app.clone(), conn.clone());
        async move { Ok::<_, Infallible>(handle(app, conn, request).await) }
    });
    let serving = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(serving);
    let Some((mut shutdown, open)) = early else {
        let _ = serving.await;
        return;
    };
    open.fetch_add(1, Ordering::SeqCst);
    let _open = Counted(open);
    tokio::select! {
        _ = serving.as_mut() => return,
        _ = shutdown.wait_for(|stop| *stop) => {}
    }
    serving.as_mut().graceful_shutdown();
    let _ = serving.await;
}

async fn handle(app: Arc<App>, conn: Arc<Conn>, request: Request<Incoming>) -> Response<Body> {
    let draining = app.draining.load(Ordering::Relaxed);
    let mut response = 'answer: {
        if request.method() == Method::POST
            && request.uri().path() == "/v1/embeddings"
            // A connection from before the drain is served as before it: a request read on it, even as
            // the grace ends, is answered (hyper's graceful shutdown then closes it), as a Python front
            // answers a request it found read (`api.draining`). Later connections go to the Python fronts.
            && (!draining || conn.early)
        {
            if let Some(serving) = app.engines.serving().filter(|s| s.info.task == "embed") {
                match embeddings(&app, serving, request).await {
                    Native::Answered(response) => break 'answer response,
                    Native::Pass(request) => break 'answer proxy(&app, &conn, request).await,
                }
            }
        }
        proxy(&app, &conn, request.map(|body| body.boxed())).await
    };
    if app.draining.load(Ordering::Relaxed) {
        // the client's next request opens a new connection, which the Service sends to a pod still in it
        response
            .headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// Passes `request` to this connection's Python front.
async fn proxy(app: &App, conn: &Conn, request: Request<Body>) -> Response<Body> {
    let mut upstream = conn.upstream.lock().await;
    if upstream
        .as_ref()
        .map(|sender| sender.is_closed())
        .unwrap_or(true)
    {
        let count = app.config.upstreams.len();
        let first = app.next_upstream.fetch_add(1, Ordering::Relaxed);
        let mut connected = None;
        for offset in 0..count {
            let path = &app.config.upstreams[(first + offset) % count];
            if let Ok(stream) = UnixStream::connect(path).await {
                if let Ok((sender, connection)) =
                    hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
                {
                    tokio::spawn(connection);
                    connected = Some(sender);
                    break;
                }
            }
        }
        *upstream = connected;
    }
    let Some(sender) = upstream.as_mut() else {
        return unavailable(
            request.uri().path(),
            "no front process is accepting requests; retry",
        );
    };
    let path = request.uri().path().to_owned();
    if sender.ready().await.is_err() {
        *upstream = None;
        return unavailable(&path, "the front process closed the connection; retry");
    }
    match sender.send_request(request).await {
        Ok(response) => response.map(|body| body.boxed()),
        Err(error) => {
            *upstream = None;
            unavailable(
                &path,
                &format!("the front process did not answer ({error}); retry"),
            )
        }
    }
}

fn unavailable(path: &str, message: &str) -> Response<Body> {
    let mut response = error_response(path, 503, message, Some(1.0));
    response
        .headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    response
}

enum Native {
    Answered(Response<Body>),
    /// Not answered here: pass it on (its body as received, or as read).
    Pass(Request<Body>),
}

struct Parsed {
    texts: Vec<String>,
    base64: bool,
}

/// The body if this front answers it exactly as a Python front would; None sends it to one.
fn parse(body: &[u8], serving: &Serving, items_limit: usize) -> Option<Parsed> {
    let Value::Object(fields) = serde_json::from_slice::<Value>(body).ok()? else {
        return None;
    };
    let mut texts = None;
    let mut base64 = false;
    for (name, value) in &fields {
        match (name.as_str(), value) {
            ("input", Value::String(text)) => texts = Some(vec![text.clone()]),
            ("input", Value::Array(items)) if !items.is_empty() => {
                texts = Some(
                    items
                        .iter()
                        .map(|item| item.as_str().map(str::to_owned))
                        .collect::<Option<Vec<_>>>()?,
                )
            }
            ("model", Value::Null)
            | ("user", Value::Null)
            | ("user", Value::String(_))
            | ("dimensions", Value::Null) => {}
            ("model", Value::String(model)) if model == &serving.info.name => {}
            ("encoding_format", Value::String(format))
                if format == "float" || format == "base64" =>
            {
                base64 = format == "base64"
            }
            ("dimensions", Value::Number(n))
                if n.as_u64().is_some()
                    && n.as_u64().map(|d| d as usize) == serving.info.dimensions => {}
            _ => return None,
        }
    }
    let texts = texts?;
    let limit = 64 * serving.info.max_input_tokens;
    if texts.len() > items_limit
        || texts
            .iter()
            .any(|t| t.is_empty() || t.chars().count() > limit)
    {
        return None;
    }
    Some(Parsed { texts, base64 })
}

fn header<'a>(request: &'a Request<Incoming>, name: &str) -> Option<&'a [u8]> {
    request.headers().get(name).map(HeaderValue::as_bytes)
}

/// (priority, timeout) from carpool's headers, None where a Python front would refuse them.
fn options(request: &Request<Incoming>, config: &Config) -> Option<(i64, Option<f64>)> {
    let priority = match header(request, "x-carpool-priority") {
        None => config.default_priority,
        Some(raw) => {
            let raw = std::str::from_utf8(raw).ok()?;
            if raw.is_empty() || !raw.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            raw.parse().ok()?
        }
    };
    if !(0..config.priority_levels).contains(&priority) {
        return None;
    }
    let timeout = match header(request, "x-carpool-timeout") {
        None => None,
        Some(raw) => {
            let value: f64 = std::str::from_utf8(raw).ok()?.parse().ok()?;
            if !value.is_finite() || value <= 0.0 {
                return None;
            }
            Some(value)
        }
    };
    Some((priority, timeout))
}

struct InFlight<'a> {
    app: &'a App,
    rid: Option<u64>,
    started: Instant,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let left = self.app.inflight.fetch_sub(1, Ordering::SeqCst) - 1;
        if let Some(rid) = self.rid {
            // the client went away before its answer: withdraw the work, count it as Python does (499)
            self.app.engines.abort(rid);
            self.app.metrics.answered(499, None, left);
        }
    }
}

async fn embeddings(app: &App, serving: Serving, request: Request<Incoming>) -> Native {
    let started = Instant::now();
    let config = &app.config;
    let length = header(&request, CONTENT_LENGTH.as_str())
        .and_then(|raw| std::str::from_utf8(raw).ok())
        .and_then(|raw| raw.parse::<usize>().ok());
    let fits = matches!(length, Some(n) if n <= config.max_body_bytes);
    let plain =
        header(&request, "expect").is_none() && header(&request, "transfer-encoding").is_none();
    let allowed = app
        .keys
        .as_ref()
        .map(|keys| keys.accepts(header(&request, "authorization")))
        .unwrap_or(true);
    let options = options(&request, config);
    let (Some((priority, timeout)), true, true, true) = (options, fits, plain, allowed) else {
        return Native::Pass(request.map(|body| body.boxed()));
    };
    let (parts, body) = request.into_parts();
    let bytes = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => {
            // the client went away while sending: nobody to answer (counted as Python counts it)
            app.metrics
                .answered(499, None, app.inflight.load(Ordering::SeqCst));
            return Native::Answered(Response::new(full(Bytes::new())));
        }
    };
    let pass = |bytes: Bytes| Native::Pass(Request::from_parts(parts.clone(), full(bytes)));
    let Some(parsed) = parse(&bytes, &serving, config.items_limit) else {
        return pass(bytes);
    };
    let arrival = monotonic();
    let mut tokens = Vec::with_capacity(parsed.texts.len());
    for text in &parsed.texts {
        match serving.codec.encode(text) {
            Ok(ids) if ids.len() <= serving.info.max_input_tokens => tokens.push(ids),
            _ => return pass(bytes),
        }
    }
    let limit = config.request_timeout_s;
    let deadline = arrival + timeout.map(|t| t.min(limit)).unwrap_or(limit);
    let prompt_tokens: usize = tokens.iter().map(Vec::len).sum();
    let rid = app.engines.next_rid();
    let request = wire::EncodeRequest {
        rid,
        front: app.engines.front,
        tokens,
        priority,
        arrival,
        deadline,
    };
    let inflight = app.inflight.fetch_add(1, Ordering::SeqCst) + 1;
    app.metrics.inflight(inflight);
    let mut guard = InFlight {
        app,
        rid: Some(rid),
        started,
    };
    let Ok(reply) = app.engines.encode(request) else {
        guard.rid = None;
        drop(guard);
        return pass(bytes);
    };
    let outcome = reply.await;
    guard.rid = None;
    let path = parts.uri.path().to_owned();
    let (status, response) = match outcome {
        Ok(Outcome::Rows { dtype, shape, data }) => {
            match answer(&serving, &dtype, shape, &data, parsed.base64, prompt_tokens) {
                Ok(payload) => {
                    let mut response = Response::new(full(payload));
                    response
                        .headers_mut()
                        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                    (200, response)
                }
                Err(message) => (500, error_response(&path, 500, &message, None)),
            }
        }
        Ok(Outcome::Error {
            kind,
            message,
            retry_after,
        }) => {
            let status = status_of(&kind);
            (status, error_response(&path, status, &message, retry_after))
        }
        Err(_) => (
            500,
            error_response(
                &path,
                500,
                "internal error: the engine connection closed",
                None,
            ),
        ),
    };
    let left = app.inflight.load(Ordering::SeqCst) - 1;
    let seconds = (status == 200).then(|| guard.started.elapsed().as_secs_f64());
    app.metrics.answered(status, seconds, left);
    drop(guard);
    Native::Answered(response)
}

/// `api.openai.embed`'s answer: one row per input, as numbers or base64 of little-endian float32.
fn answer(
    serving: &Serving,
    dtype: &str,
    shape: (usize, usize),
    data: &[u8],
    base64: bool,
    tokens: usize,
) -> Result<Vec<u8>, String> {
    let (rows, width) = shape;
    let values: Vec<f32> = match dtype {
        "<f4" | "float32" | "=f4" | "f4" if data.len() == rows * width * 4 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        other => {
            return Err(format!(
                "internal error: the engine sent rows of {other} ({} bytes for {rows}x{width})",
                data.len()
            ))
        }
    };
    let mut out = Vec::with_capacity(64 + rows * width * 12);
    out.extend_from_slice(b"{\"object\":\"list\",\"data\":[");
    let mut number = ryu::Buffer::new();
    for (index, row) in values.chunks(width.max(1)).enumerate().take(rows) {
        if index > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"object\":\"embedding\",\"index\":");
        out.extend_from_slice(index.to_string().as_bytes());
        out.extend_from_slice(b",\"embedding\":");
        if base64 {
            let bytes: Vec<u8> = row.iter().flat_map(|v| v.to_le_bytes()).collect();
            out.push(b'"');
            out.extend_from_slice(
                base64::engine::general_purpose::STANDARD
                    .encode(bytes)
                    .as_bytes(),
            );
            out.push(b'"');
        } else {
            out.push(b'[');
            for (i, value) in row.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                if value.is_finite() {
                    out.extend_from_slice(number.format_finite(*value).as_bytes());
                } else {
                    out.extend_from_slice(b"null"); // as orjson writes a non-finite float
                }
            }
            out.push(b']');
        }
        out.push(b'}');
    }
    out.extend_from_slice(b"],\"model\":");
    out.extend_from_slice(
        serde_json::to_string(&serving.info.name)
            .unwrap()
            .as_bytes(),
    );
    out.extend_from_slice(
        format!(",\"usage\":{{\"prompt_tokens\":{tokens},\"total_tokens\":{tokens}}}}}").as_bytes(),
    );
    Ok(out)
}

/// `errors.STATUS` by the error's class name (`wire.ErrorOutput.kind`).
fn status_of(kind: &str) -> u16 {
    match kind {
        "InvalidInput" | "InputTooLong" | "InvalidAdapter" => 400,
        "Forbidden" => 403,
        "ModelNotFound" => 404,
        "QueueFull" => 429,
        "Cancelled" => 499,
        "NotReady" => 503,
        "DeadlineExceeded" => 504,
        _ => 500,
    }
}

/// `api.errors.error_payload` for an OpenAI path, with `Retry-After` as `api.errors.retry_after` writes it.
fn error_response(
    path: &str,
    status: u16,
    message: &str,
    retry_after: Option<f64>,
) -> Response<Body> {
    let payload = if path.starts_with("/v2") {
        serde_json::json!({ "error": message })
    } else {
        let kind = match status {
            400 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_exceeded",
            503 => "service_unavailable",
            504 => "timeout",
            _ => "server_error",
        };
        serde_json::json!({ "error": { "message": message, "type": kind, "param": null, "code": status } })
    };
    let mut response = Response::new(full(payload.to_string()));
    *response.status_mut() =
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(wait) = retry_after.filter(|w| *w > 0.0) {
        let seconds = (wait.ceil() as u64).max(1);
        response
            .headers_mut()
            .insert("retry-after", HeaderValue::from(seconds));
    }
    response
}
