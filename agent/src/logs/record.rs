//! The one JSON log schema (`--log-format json`): every record muster writes, whether a rank's
//! line, one of the agent's own messages, the root-cause report or a configuration error, is one
//! object on one line with the same core fields, so a log pipeline needs one parser.
//!
//! | field | in | type | meaning |
//! |---|---|---|---|
//! | `ts` | all | string | RFC 3339 UTC with milliseconds, when muster wrote the record |
//! | `level` | all | string | `ERROR`, `WARN`, `INFO`, `DEBUG` or `TRACE` (rank lines: `INFO`) |
//! | `source` | all | string | `agent` or `rank` |
//! | `host` | all | string | short host name |
//! | `msg` | all | string | the text (a rank's line without its line end) |
//! | `rank`, `local_rank` | rank; agent (optional) | integer | the worker the record is about |
//! | `stream` | rank | string | `stdout` or `stderr` |
//! | `progress` | rank | bool | a coalesced progress-bar update (`\r`), not an ordinary line |
//! | `event` | agent (optional) | string | `root_cause`, `error` |
//! | `fields` | agent (optional) | object | structured fields of an agent message |
//!
//! Event records add their own fields (see docs/launch.md); a consumer keys on `event`.

use std::fmt::Write as _;
use std::time::SystemTime;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// `source` of the agent's records.
pub const AGENT: &str = "agent";
/// `source` of a rank's lines.
pub const RANK: &str = "rank";

/// A JSON string literal (quotes and escapes included).
fn quoted(text: &str, out: &mut Vec<u8>) {
    // Writing a &str into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, text);
}

/// Appends one rank line as a record of the schema, newline included; `ts` is its timestamp
/// ([`super::utc_timestamp`]). Written by hand because it runs once per line of a chatty rank.
#[allow(clippy::too_many_arguments)]
pub fn rank_line(
    ts: &str,
    host: &str,
    rank: u32,
    local_rank: u32,
    stream: &str,
    progress: bool,
    text: &[u8],
    out: &mut Vec<u8>,
) {
    out.extend_from_slice(b"{\"ts\":\"");
    out.extend_from_slice(ts.as_bytes());
    out.extend_from_slice(b"\",\"level\":\"INFO\",\"source\":\"rank\",\"host\":");
    quoted(host, out);
    let _ = write!(
        VecWriter(out),
        ",\"rank\":{rank},\"local_rank\":{local_rank},\"stream\":\"{stream}\",\"progress\":{progress},\"msg\":"
    );
    quoted(&String::from_utf8_lossy(text), out);
    out.extend_from_slice(b"}\n");
}

struct VecWriter<'a>(&'a mut Vec<u8>);

impl std::fmt::Write for VecWriter<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

/// An agent record: the core fields, then `extra` (event fields), newline included.
pub fn agent_record(level: &str, host: &str, msg: &str, extra: Map<String, Value>) -> String {
    let mut obj = Map::new();
    obj.insert("ts".into(), super::utc_timestamp(SystemTime::now()).into());
    obj.insert("level".into(), level.into());
    obj.insert("source".into(), AGENT.into());
    obj.insert("host".into(), host.into());
    obj.insert("msg".into(), msg.into());
    for (key, value) in extra {
        obj.entry(key).or_insert(value);
    }
    let mut line = Value::Object(obj).to_string();
    line.push('\n');
    line
}

/// The agent's `tracing` events as records of the schema.
pub struct JsonEvents {
    host: String,
}

impl JsonEvents {
    pub fn new(host: String) -> Self {
        Self { host }
    }
}

/// Collects an event's fields: `message` becomes `msg`, the rest go to `fields`.
#[derive(Default)]
struct Fields {
    message: String,
    rest: Map<String, Value>,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            value.clone_into(&mut self.message);
        } else {
            self.rest.insert(field.name().into(), value.into());
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.rest.insert(field.name().into(), value.into());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.rest.insert(field.name().into(), value.into());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.rest.insert(field.name().into(), value.into());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        } else {
            self.rest
                .insert(field.name().into(), format!("{value:?}").into());
        }
    }
}

impl<S, N> FormatEvent<S, N> for JsonEvents
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let mut extra = Map::new();
        if !fields.rest.is_empty() {
            extra.insert("fields".into(), Value::Object(fields.rest));
        }
        let level = event.metadata().level().as_str();
        writer.write_str(&agent_record(level, &self.host, &fields.message, extra))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_lines_escape_and_mark_progress() {
        let mut out = Vec::new();
        rank_line(
            "2026-11-30T12:38:23.123Z",
            "h\"1",
            3,
            1,
            "stderr",
            true,
            b"caf\xc3\xa9 \"q\"\t\xff",
            &mut out,
        );
        assert_eq!(out.last(), Some(&b'\n'));
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["msg"], "café \"q\"\t\u{fffd}");
        assert_eq!(v["host"], "h\"1");
        assert_eq!(
            (v["rank"].as_u64(), v["local_rank"].as_u64()),
            (Some(3), Some(1))
        );
        assert_eq!(
            (v["stream"].as_str(), v["progress"].as_bool()),
            (Some("stderr"), Some(true))
        );
        assert_eq!(
            (v["source"].as_str(), v["level"].as_str()),
            (Some("rank"), Some("INFO"))
        );
        assert_eq!(v["ts"], "2026-11-30T12:38:23.123Z");
    }

    #[test]
    fn agent_records_keep_their_core_fields() {
        let mut extra = Map::new();
        extra.insert("event".into(), "error".into());
        extra.insert("msg".into(), "not this".into());
        let line = agent_record("ERROR", "h", "boom", extra);
        assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["msg"], "boom");
        assert_eq!(v["event"], "error");
        assert_eq!(v["source"], "agent");
    }
}
