//! This front's share of the request metrics, written where prometheus-client's multiprocess mode reads
//! every process's values (`PROMETHEUS_MULTIPROC_DIR`, see `carpool.runtime.metrics`): the same files
//! (`counter_<pid>.db`, `histogram_<pid>.db`, `gauge_livesum_<pid>.db`) in `MmapedDict`'s layout, the
//! same metric names and labels as a Python front's `RuntimeMetrics`, so `/metrics` on any front adds this
//! front's requests to everyone's. Each value is written as its request is answered, under a lock, so a
//! scrape that follows an answer counts it.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use memmap2::MmapMut;

const INITIAL_SIZE: u64 = 1 << 16;

/// `metrics._LATENCY_BUCKETS`.
pub const LATENCY_BUCKETS: [f64; 17] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0,
];

/// One `MmapedDict` file: a used-length header, then (key length, key padded to 8, value, timestamp).
struct Dict {
    path: PathBuf,
    map: MmapMut,
    used: usize,
    positions: HashMap<String, usize>,
}

impl Dict {
    fn open(path: PathBuf) -> std::io::Result<Dict> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)?;
        if file.metadata()?.len() == 0 {
            file.set_len(INITIAL_SIZE)?;
        }
        let mut map = unsafe { MmapMut::map_mut(&file)? };
        map[0..4].copy_from_slice(&8i32.to_le_bytes());
        Ok(Dict {
            path,
            map,
            used: 8,
            positions: HashMap::new(),
        })
    }

    fn position(&mut self, key: &str) -> std::io::Result<usize> {
        if let Some(&pos) = self.positions.get(key) {
            return Ok(pos);
        }
        let encoded = key.as_bytes();
        let padding = 8 - (encoded.len() + 4) % 8;
        let size = 4 + encoded.len() + padding + 16;
        if self.used + size > self.map.len() {
            let mut capacity = self.map.len() as u64;
            while self.used as u64 + size as u64 > capacity {
                capacity *= 2;
            }
            let file = OpenOptions::new().read(true).write(true).open(&self.path)?;
            file.set_len(capacity)?;
            self.map = unsafe { MmapMut::map_mut(&file)? };
        }
        let start = self.used;
        self.map[start..start + 4].copy_from_slice(&(encoded.len() as i32).to_le_bytes());
        self.map[start + 4..start + 4 + encoded.len()].copy_from_slice(encoded);
        for byte in &mut self.map[start + 4 + encoded.len()..start + 4 + encoded.len() + padding] {
            *byte = b' ';
        }
        let value = start + 4 + encoded.len() + padding;
        self.map[value..value + 16].fill(0);
        self.used += size;
        self.map[0..4].copy_from_slice(&(self.used as i32).to_le_bytes());
        self.positions.insert(key.to_owned(), value);
        Ok(value)
    }

    fn read(&self, pos: usize) -> f64 {
        f64::from_le_bytes(self.map[pos..pos + 8].try_into().unwrap())
    }

    fn write(&mut self, key: &str, value: f64) {
        if let Ok(pos) = self.position(key) {
            // value and timestamp in one copy (as MmapedDict writes both doubles at once)
            let mut both = [0u8; 16];
            both[..8].copy_from_slice(&value.to_le_bytes());
            self.map[pos..pos + 16].copy_from_slice(&both);
        }
    }

    fn add(&mut self, key: &str, amount: f64) {
        if let Ok(pos) = self.position(key) {
            let value = self.read(pos) + amount;
            self.write(key, value);
        }
    }
}

fn key(metric: &str, name: &str, labels: &[(&str, &str)], help: &str) -> String {
    // `mmap_key`: [metric_name, name, labels, help]; the reader parses it as JSON.
    let labels: serde_json::Map<String, serde_json::Value> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), serde_json::Value::from(*v)))
        .collect();
    serde_json::json!([metric, name, labels, help]).to_string()
}

const REQUESTS_HELP: &str = "Requests answered, by HTTP status code (gRPC calls by the HTTP status their code stands for, see `api.grpc.status`) and protocol (http or grpc).";
const DURATION_HELP: &str =
    "Time from arrival to answer, per request (label `protocol`: http or grpc).";
const INFLIGHT_HELP: &str = "Requests accepted and not yet answered.";

struct Files {
    counters: Dict,
    histograms: Dict,
    gauges: Dict,
    /// `carpool_requests_total`'s key by status, built once each (the keys are JSON: a request should
    /// not pay for building one).
    request_keys: HashMap<u16, String>,
    bucket_keys: Vec<String>,
    sum_key: String,
    inflight_key: String,
}

pub struct Metrics {
    model: String,
    files: Option<Mutex<Files>>,
}

impl Metrics {
    /// Writes into `folder` (None: metrics off, as without multiprocess mode in a test).
    pub fn new(folder: Option<&Path>, model: &str) -> std::io::Result<Metrics> {
        let files = match folder {
            None => None,
            Some(folder) => {
                let pid = std::process::id();
                let labels = [("model", model), ("protocol", "http")];
                let bucket_keys = LATENCY_BUCKETS
                    .iter()
                    .map(|b| format!("{b:?}"))
                    .chain(std::iter::once("+Inf".to_owned()))
                    .map(|le| {
                        let mut with_le = labels.to_vec();
                        with_le.push(("le", le.as_str()));
                        key(
                            "carpool_request_duration_seconds",
                            "carpool_request_duration_seconds_bucket",
                            &with_le,
                            DURATION_HELP,
                        )
                    })
                    .collect();
                let sum_key = key(
                    "carpool_request_duration_seconds",
                    "carpool_request_duration_seconds_sum",
                    &labels,
                    DURATION_HELP,
                );
                let inflight_key = key(
                    "carpool_inflight_requests",
                    "carpool_inflight_requests",
                    &[("model", model)],
                    INFLIGHT_HELP,
                );
                Some(Mutex::new(Files {
                    counters: Dict::open(folder.join(format!("counter_{pid}.db")))?,
                    histograms: Dict::open(folder.join(format!("histogram_{pid}.db")))?,
                    gauges: Dict::open(folder.join(format!("gauge_livesum_{pid}.db")))?,
                    request_keys: HashMap::new(),
                    bucket_keys,
                    sum_key,
                    inflight_key,
                }))
            }
        };
        Ok(Metrics {
            model: model.to_owned(),
            files,
        })
    }

    /// A request answered with `status` (and its duration, where it counts: successes), and the
    /// requests this front holds after it.
    pub fn answered(&self, status: u16, seconds: Option<f64>, inflight: usize) {
        let Some(files) = &self.files else { return };
        let mut guard = files.lock().unwrap();
        let files = &mut *guard;
        let requests = files.request_keys.entry(status).or_insert_with(|| {
            key(
                "carpool_requests",
                "carpool_requests_total",
                &[
                    ("model", &self.model),
                    ("status", &status.to_string()),
                    ("protocol", "http"),
                ],
                REQUESTS_HELP,
            )
        });
        files.counters.add(requests, 1.0);
        if let Some(seconds) = seconds {
            let bucket = LATENCY_BUCKETS
                .iter()
                .position(|&b| seconds <= b)
                .unwrap_or(LATENCY_BUCKETS.len());
            files.histograms.add(&files.bucket_keys[bucket], 1.0);
            files.histograms.add(&files.sum_key, seconds);
        }
        files.gauges.write(&files.inflight_key, inflight as f64);
    }

    /// The requests this front holds now.
    pub fn inflight(&self, count: usize) {
        let Some(files) = &self.files else { return };
        let mut guard = files.lock().unwrap();
        let files = &mut *guard;
        files.gauges.write(&files.inflight_key, count as f64);
    }
}
