//! Log lines in the runtime's format (`carpool.runtime.logs`: `server.log_format` text or json, at
//! `server.log_level`), on standard error as the Python processes write them, under the logger name
//! `carpool.native`.

use std::io::Write;
use std::sync::OnceLock;

struct Settings {
    json: bool,
    level: u8,
}

static SETTINGS: OnceLock<Settings> = OnceLock::new();

fn rank(level: &str) -> u8 {
    match level {
        "debug" => 10,
        "info" => 20,
        "warning" => 30,
        "error" => 40,
        _ => 50,
    }
}

pub fn configure(format: &str, level: &str) {
    let _ = SETTINGS.set(Settings {
        json: format == "json",
        level: rank(level),
    });
}

pub fn log(level: &str, message: &str) {
    let settings = SETTINGS.get_or_init(|| Settings {
        json: false,
        level: 20,
    });
    if rank(level) < settings.level {
        return;
    }
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    unsafe { libc::gmtime_r(&ts.tv_sec, &mut tm) };
    let millis = ts.tv_nsec / 1_000_000;
    let (date, time) = (
        format!(
            "{:04}-{:02}-{:02}",
            tm.tm_year + 1900,
            tm.tm_mon + 1,
            tm.tm_mday
        ),
        format!("{:02}:{:02}:{:02}", tm.tm_hour, tm.tm_min, tm.tm_sec),
    );
    let line = if settings.json {
        serde_json::json!({
            "time": format!("{date}T{time}.{millis:03}Z"),
            "level": level,
            "logger": "carpool.native",
            "message": message,
        })
        .to_string()
    } else {
        format!(
            "{date} {time},{millis:03} {} carpool.native: {message}",
            level.to_uppercase()
        )
    };
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}
