//! `muster-loadgen`: a load generator that speaks the raw c10d TCPStore protocol, so the numbers
//! measure the *server* (muster's store, or torch's libuv and classic servers) rather than a
//! Python client. It is the benchmark behind `scripts/bench.d/10-store`.
//!
//! Workloads (the methodology of shared/bench/tcpstore_load.c, re-implemented here):
//! - request/reply: each of C connections (one thread each) runs closed-loop GETs of one 64-byte
//!   value, then closed-loop ADDs on a counter of its own; aggregate ops/s;
//! - pipelined SET: each connection writes batches of 256 SETs (16-byte values) without reading,
//!   fenced at the end by one GET so every SET has been processed; aggregate SET/s;
//! - rendezvous of N sockets from one thread: connect all, VALIDATE+PING all, ADD a counter on all,
//!   the client that saw N SETs `done`, WAIT `done` on all, 3×GET on all. Phase times in ms;
//!   "post-connect" (total minus connect) is the server's share once the sockets exist.
//!
//! `compare` runs every workload against several servers, interleaved (each measurement runs on
//! every server before the next one starts, so background load hits them alike), and prints one
//! markdown table with the ratio of the first server to the baseline.

use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::ExitCode;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

const MAGIC: u32 = 0x3C85_F7CE;
const VALIDATE: u8 = 0;
const SET: u8 = 1;
const GET: u8 = 3;
const ADD: u8 = 4;
const WAIT: u8 = 6;
const PING: u8 = 13;

/// Bound on every read: a server that stops answering fails the measurement instead of hanging.
const READ_TIMEOUT: Duration = Duration::from_secs(120);
/// How long `dial` retries a refused or reset connect (listen backlog overflow under a storm).
const DIAL_PATIENCE: Duration = Duration::from_secs(30);
const SET_BATCH: usize = 256;
const VALUE_LEN: usize = 64;

const USAGE: &str = "\
usage:
  muster-loadgen compare --server NAME=HOST:PORT [--server …] [--baseline NAME]
                         [--conns 1,4,16,64] [--rdzv 1024,4096,16384] [--secs 2] [--reps 3]
  muster-loadgen ops  --addr HOST:PORT [--conns 1] [--secs 2]
  muster-loadgen rdzv --addr HOST:PORT [--n 1024] [--reps 3]
The first --server is the one under test; ratios are it over --baseline (default: the second).";

fn main() -> ExitCode {
    match run(&std::env::args().skip(1).collect::<Vec<_>>()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("muster-loadgen: {err}");
            ExitCode::from(2)
        }
    }
}

type Res<T> = Result<T, String>;

struct Args {
    servers: Vec<(String, SocketAddr)>,
    baseline: Option<String>,
    conns: Vec<usize>,
    rdzv: Vec<usize>,
    secs: f64,
    reps: usize,
}

fn list(v: &str) -> Res<Vec<usize>> {
    v.split(',')
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.trim()
                .parse()
                .map_err(|e| format!("bad number {s:?}: {e}"))
        })
        .collect()
}

fn addr(v: &str) -> Res<SocketAddr> {
    v.parse()
        .map_err(|e| format!("bad address {v:?}: {e} (use HOST:PORT with a numeric host)"))
}

fn parse_args(argv: &[String]) -> Res<Args> {
    let mut a = Args {
        servers: Vec::new(),
        baseline: None,
        conns: vec![1, 4, 16, 64],
        rdzv: vec![1024, 4096, 16384],
        secs: 2.0,
        reps: 3,
    };
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        match flag.as_str() {
            "--server" => {
                let (name, at) = value
                    .split_once('=')
                    .ok_or_else(|| format!("--server wants NAME=HOST:PORT, got {value:?}"))?;
                a.servers.push((name.to_owned(), addr(at)?));
            }
            "--addr" => a.servers.push(("server".to_owned(), addr(value)?)),
            "--baseline" => a.baseline = Some(value.clone()),
            "--conns" => a.conns = list(value)?,
            "--rdzv" | "--n" => a.rdzv = list(value)?,
            "--secs" => a.secs = value.parse().map_err(|e| format!("bad --secs: {e}"))?,
            "--reps" => a.reps = value.parse().map_err(|e| format!("bad --reps: {e}"))?,
            other => return Err(format!("unknown flag {other}\n{USAGE}")),
        }
    }
    if a.servers.is_empty() {
        return Err(format!("no server given\n{USAGE}"));
    }
    Ok(a)
}

fn run(argv: &[String]) -> Res<()> {
    let Some((mode, rest)) = argv.split_first() else {
        return Err(USAGE.to_owned());
    };
    let args = parse_args(rest)?;
    match mode.as_str() {
        "ops" => {
            let at = args.servers[0].1;
            seed(at).map_err(|e| format!("{at}: {e}"))?;
            for &c in &args.conns {
                let r = ops(at, c, args.secs).map_err(|e| format!("{at}: {e}"))?;
                println!(
                    "{{\"mode\":\"ops\",\"conns\":{c},\"get_per_s\":{:.0},\"add_per_s\":{:.0},\"set_per_s\":{:.0}}}",
                    r.get, r.add, r.set
                );
            }
            Ok(())
        }
        "rdzv" => {
            let at = args.servers[0].1;
            seed(at).map_err(|e| format!("{at}: {e}"))?;
            for &n in &args.rdzv {
                for rep in 0..args.reps {
                    let p = rendezvous(at, n, rep).map_err(|e| format!("{at}: {e}"))?;
                    println!(
                        "{{\"mode\":\"rdzv\",\"n\":{n},\"rep\":{rep},\"connect_ms\":{:.2},\"handshake_ms\":{:.2},\"add_ms\":{:.2},\"release_ms\":{:.2},\"get_ms\":{:.2},\"total_ms\":{:.2}}}",
                        p.connect, p.handshake, p.add, p.release, p.get, p.total()
                    );
                    thread::sleep(Duration::from_millis(200));
                }
            }
            Ok(())
        }
        "compare" => compare(&args),
        other => Err(format!("unknown mode {other}\n{USAGE}")),
    }
}

// ------------------------------------------------------------------------------------------------
// a raw connection

struct Conn {
    s: TcpStream,
    out: Vec<u8>,
}

impl Conn {
    fn dial(at: SocketAddr) -> io::Result<Conn> {
        let started = Instant::now();
        loop {
            match TcpStream::connect(at) {
                Ok(s) => {
                    s.set_nodelay(true)?;
                    s.set_read_timeout(Some(READ_TIMEOUT))?;
                    return Ok(Conn {
                        s,
                        out: Vec::with_capacity(4096),
                    });
                }
                Err(e)
                    if started.elapsed() < DIAL_PATIENCE
                        && e.kind() != io::ErrorKind::InvalidInput =>
                {
                    thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn u8(&mut self, v: u8) -> &mut Self {
        self.out.push(v);
        self
    }

    fn u32(&mut self, v: u32) -> &mut Self {
        self.out.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn u64(&mut self, v: u64) -> &mut Self {
        self.out.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.u64(b.len() as u64);
        self.out.extend_from_slice(b);
        self
    }

    fn flush(&mut self) -> io::Result<()> {
        self.s.write_all(&self.out)?;
        self.out.clear();
        Ok(())
    }

    fn read_array<const N: usize>(&mut self) -> io::Result<[u8; N]> {
        let mut b = [0u8; N];
        self.s.read_exact(&mut b)?;
        Ok(b)
    }

    fn read_i64(&mut self) -> io::Result<i64> {
        Ok(i64::from_le_bytes(self.read_array()?))
    }

    /// A length-prefixed value, drained without keeping it.
    fn skip_blob(&mut self) -> io::Result<u64> {
        let len = u64::from_le_bytes(self.read_array()?);
        let mut left = len;
        let mut sink = [0u8; 4096];
        while left > 0 {
            let take = usize::try_from(left.min(sink.len() as u64)).unwrap_or(sink.len());
            self.s.read_exact(&mut sink[..take])?;
            left -= take as u64;
        }
        Ok(len)
    }

    fn queue_handshake(&mut self, nonce: u32) -> &mut Self {
        self.u8(VALIDATE).u32(MAGIC).u8(PING).u32(nonce)
    }

    fn check_ping(&mut self, nonce: u32) -> io::Result<()> {
        let echo = u32::from_le_bytes(self.read_array()?);
        if echo == nonce {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("PING echoed {echo}, sent {nonce}"),
            ))
        }
    }

    fn handshake(at: SocketAddr, nonce: u32) -> io::Result<Conn> {
        let mut c = Conn::dial(at)?;
        c.queue_handshake(nonce).flush()?;
        c.check_ping(nonce)?;
        Ok(c)
    }
}

/// The three 64-byte values the GET workloads read (what torch's Python client calls k0..k2).
fn seed(at: SocketAddr) -> io::Result<()> {
    let mut c = Conn::handshake(at, 1)?;
    for k in [&b"/k0"[..], b"/k1", b"/k2"] {
        c.u8(SET).bytes(k).bytes(&[b'x'; VALUE_LEN]);
    }
    c.u8(GET).bytes(b"/k2").flush()?;
    let len = c.skip_blob()?;
    if len == VALUE_LEN as u64 {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("seeded 64 bytes, GET returned {len}"),
        ))
    }
}

/// Unique per call within this process, for fresh key names on a server that outlives runs.
fn stamp() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

// ------------------------------------------------------------------------------------------------
// request/reply and pipelined SET

/// A barrier that a failing thread can break, so the others give up instead of waiting forever.
struct Gate {
    parties: usize,
    state: Mutex<(usize, u64, bool)>, // (arrived, generation, broken)
    cv: Condvar,
}

impl Gate {
    fn new(parties: usize) -> Gate {
        Gate {
            parties,
            state: Mutex::new((0, 0, false)),
            cv: Condvar::new(),
        }
    }

    fn wait(&self) -> io::Result<()> {
        let broken = || io::Error::other("another load thread failed");
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if st.2 {
            return Err(broken());
        }
        st.0 += 1;
        if st.0 == self.parties {
            st.0 = 0;
            st.1 += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let generation = st.1;
        let (st, timeout) = self
            .cv
            .wait_timeout_while(st, READ_TIMEOUT, |st| st.1 == generation && !st.2)
            .unwrap_or_else(PoisonError::into_inner);
        if st.2 || timeout.timed_out() {
            Err(broken())
        } else {
            Ok(())
        }
    }

    fn break_it(&self) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).2 = true;
        self.cv.notify_all();
    }
}

#[derive(Clone, Copy, Default)]
struct OpsRate {
    get: f64,
    add: f64,
    set: f64,
}

struct ThreadCounts {
    n: [u64; 3],
    secs: [f64; 3],
}

fn ops_thread(at: SocketAddr, id: usize, secs: f64, gate: &Gate) -> io::Result<ThreadCounts> {
    let result = ops_phases(at, id, secs, gate);
    if let Err(e) = &result {
        eprintln!("load thread {id}: {e}");
        gate.break_it();
    }
    result
}

fn ops_phases(at: SocketAddr, id: usize, secs: f64, gate: &Gate) -> io::Result<ThreadCounts> {
    let mut c = Conn::handshake(at, id as u32 + 10)?;
    let ctr = format!("ops/{}/{}/{id}/ctr", std::process::id(), stamp());
    let run = Duration::from_secs_f64(secs);
    let mut counts = ThreadCounts {
        n: [0; 3],
        secs: [0.0; 3],
    };

    gate.wait()?;
    let t0 = Instant::now();
    while t0.elapsed() < run {
        for _ in 0..64 {
            c.u8(GET).bytes(b"/k0").flush()?;
            c.skip_blob()?;
        }
        counts.n[0] += 64;
    }
    counts.secs[0] = t0.elapsed().as_secs_f64();

    gate.wait()?;
    let t0 = Instant::now();
    let mut expect = 0;
    while t0.elapsed() < run {
        for _ in 0..64 {
            c.u8(ADD).bytes(ctr.as_bytes()).u64(1).flush()?;
            expect += 1;
            let v = c.read_i64()?;
            if v != expect {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("ADD returned {v}, expected {expect}"),
                ));
            }
        }
        counts.n[1] += 64;
    }
    counts.secs[1] = t0.elapsed().as_secs_f64();

    gate.wait()?;
    let t0 = Instant::now();
    let mut n: u64 = 0;
    let mut key = String::with_capacity(32);
    while t0.elapsed() < run {
        for i in 0..SET_BATCH as u64 {
            key.clear();
            let _ = write!(key, "set/{id}/{}", (n + i) & 4095);
            c.u8(SET).bytes(key.as_bytes()).bytes(&[b'v'; 16]);
        }
        c.flush()?;
        n += SET_BATCH as u64;
    }
    c.u8(GET).bytes(b"/k0").flush()?;
    c.skip_blob()?;
    counts.n[2] = n;
    counts.secs[2] = t0.elapsed().as_secs_f64();
    Ok(counts)
}

fn ops(at: SocketAddr, conns: usize, secs: f64) -> Res<OpsRate> {
    let gate = Arc::new(Gate::new(conns));
    let handles: Vec<_> = (0..conns)
        .map(|id| {
            let gate = Arc::clone(&gate);
            thread::spawn(move || ops_thread(at, id, secs, &gate))
        })
        .collect();
    let mut total = [0u64; 3];
    let mut longest = [0f64; 3];
    let mut first_err = None;
    for h in handles {
        match h.join() {
            Ok(Ok(c)) => {
                for i in 0..3 {
                    total[i] += c.n[i];
                    longest[i] = longest[i].max(c.secs[i]);
                }
            }
            Ok(Err(e)) => {
                first_err.get_or_insert_with(|| e.to_string());
            }
            Err(_) => {
                first_err.get_or_insert_with(|| "a load thread panicked".to_owned());
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    Ok(OpsRate {
        get: total[0] as f64 / longest[0],
        add: total[1] as f64 / longest[1],
        set: total[2] as f64 / longest[2],
    })
}

// ------------------------------------------------------------------------------------------------
// the N-socket rendezvous

#[derive(Clone, Copy, Default)]
struct Phases {
    connect: f64,
    handshake: f64,
    add: f64,
    release: f64,
    get: f64,
}

impl Phases {
    fn total(&self) -> f64 {
        self.connect + self.handshake + self.add + self.release + self.get
    }

    fn post_connect(&self) -> f64 {
        self.total() - self.connect
    }
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn rendezvous(at: SocketAddr, n: usize, rep: usize) -> Res<Phases> {
    let io = |what: &str, e: io::Error| format!("rendezvous of {n}, {what}: {e}");
    let tag = format!("rdzv/{}/{n}/{rep}/{}", std::process::id(), stamp());
    let count_key = format!("{tag}/count");
    let done_key = format!("{tag}/done");
    let mut p = Phases::default();

    let t = Instant::now();
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(Conn::dial(at).map_err(|e| io("connect", e))?);
    }
    p.connect = ms(t);

    let t = Instant::now();
    for (i, c) in conns.iter_mut().enumerate() {
        c.queue_handshake(i as u32)
            .flush()
            .map_err(|e| io("handshake", e))?;
    }
    for (i, c) in conns.iter_mut().enumerate() {
        c.check_ping(i as u32).map_err(|e| io("handshake", e))?;
    }
    p.handshake = ms(t);

    let t = Instant::now();
    for c in &mut conns {
        c.u8(ADD)
            .bytes(count_key.as_bytes())
            .u64(1)
            .flush()
            .map_err(|e| io("add", e))?;
    }
    let mut last = None;
    let mut seen = vec![false; n + 1];
    for (i, c) in conns.iter_mut().enumerate() {
        let v = c.read_i64().map_err(|e| io("add", e))?;
        let slot = usize::try_from(v)
            .ok()
            .filter(|&v| v >= 1 && v <= n && !seen[v]);
        let Some(slot) = slot else {
            return Err(format!(
                "rendezvous of {n}: ADD returned {v} (duplicate or out of range)"
            ));
        };
        seen[slot] = true;
        if slot == n {
            last = Some(i);
        }
    }
    p.add = ms(t);
    let last = last.ok_or_else(|| format!("rendezvous of {n}: nobody saw the count reach {n}"))?;

    let t = Instant::now();
    for (i, c) in conns.iter_mut().enumerate() {
        if i != last {
            c.u8(WAIT)
                .u64(1)
                .bytes(done_key.as_bytes())
                .flush()
                .map_err(|e| io("wait", e))?;
        }
    }
    conns[last]
        .u8(SET)
        .bytes(done_key.as_bytes())
        .bytes(b"1")
        .u8(WAIT)
        .u64(1)
        .bytes(done_key.as_bytes())
        .flush()
        .map_err(|e| io("release", e))?;
    for c in &mut conns {
        let [b] = c.read_array::<1>().map_err(|e| io("release", e))?;
        if b != 0 {
            return Err(format!(
                "rendezvous of {n}: WAIT answered {b}, not STOP_WAITING"
            ));
        }
    }
    p.release = ms(t);

    let t = Instant::now();
    for c in &mut conns {
        c.u8(GET)
            .bytes(b"/k0")
            .u8(GET)
            .bytes(b"/k1")
            .u8(GET)
            .bytes(b"/k2")
            .flush()
            .map_err(|e| io("get", e))?;
    }
    for c in &mut conns {
        for _ in 0..3 {
            let len = c.skip_blob().map_err(|e| io("get", e))?;
            if len != VALUE_LEN as u64 {
                return Err(format!("rendezvous of {n}: GET returned {len} bytes"));
            }
        }
    }
    p.get = ms(t);
    Ok(p)
}

// ------------------------------------------------------------------------------------------------
// side by side

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

struct Row {
    label: String,
    higher_is_better: bool,
    cells: Vec<Option<f64>>,
    note: Vec<String>,
}

fn fmt_value(v: Option<f64>, higher_is_better: bool) -> String {
    match v {
        None => "failed".to_owned(),
        Some(v) if higher_is_better && v >= 1e6 => format!("{:.2} M", v / 1e6),
        Some(v) if higher_is_better => format!("{:.1} k", v / 1e3),
        Some(v) => format!("{v:.0} ms"),
    }
}

fn compare(args: &Args) -> Res<()> {
    let names: Vec<&str> = args.servers.iter().map(|(n, _)| n.as_str()).collect();
    let base = match &args.baseline {
        Some(b) => names
            .iter()
            .position(|n| n == b)
            .ok_or_else(|| format!("no server named {b}"))?,
        None => usize::from(names.len() > 1),
    };
    let mut alive = vec![true; names.len()];
    for (i, (name, at)) in args.servers.iter().enumerate() {
        if let Err(e) = seed(*at) {
            eprintln!("{name} ({at}): {e}; its cells read \"failed\"");
            alive[i] = false;
        }
    }
    let mut rows: Vec<Row> = Vec::new();
    for &c in &args.conns {
        let mut r = [
            Row {
                label: format!("GET ops/s, {c} conn"),
                higher_is_better: true,
                cells: vec![],
                note: vec![],
            },
            Row {
                label: format!("ADD ops/s, {c} conn"),
                higher_is_better: true,
                cells: vec![],
                note: vec![],
            },
            Row {
                label: format!("pipelined SET/s, {c} conn"),
                higher_is_better: true,
                cells: vec![],
                note: vec![],
            },
        ];
        // Every server is measured once per repetition, interleaved, so background load drifts
        // over all of them alike; the cells are medians.
        let mut samples = vec![[Vec::new(), Vec::new(), Vec::new()]; names.len()];
        for _ in 0..args.reps {
            for (i, (name, at)) in args.servers.iter().enumerate() {
                if !alive[i] {
                    continue;
                }
                match ops(*at, c, args.secs) {
                    Ok(x) => {
                        eprintln!(
                            "{name}: {c} conn: GET {:.0}/s ADD {:.0}/s SET {:.0}/s",
                            x.get, x.add, x.set
                        );
                        samples[i][0].push(x.get);
                        samples[i][1].push(x.add);
                        samples[i][2].push(x.set);
                    }
                    Err(e) => eprintln!("{name}: {c} conn: {e}"),
                }
            }
        }
        for [get, add, set] in samples {
            r[0].cells.push(median(get));
            r[1].cells.push(median(add));
            r[2].cells.push(median(set));
        }
        rows.extend(r);
    }
    for &n in &args.rdzv {
        let mut totals = vec![Vec::new(); names.len()];
        let mut posts = vec![Vec::new(); names.len()];
        let mut notes = vec![String::new(); names.len()];
        for rep in 0..args.reps {
            for (i, (name, at)) in args.servers.iter().enumerate() {
                if !alive[i] {
                    continue;
                }
                match rendezvous(*at, n, rep) {
                    Ok(p) => {
                        eprintln!(
                            "{name}: rdzv {n} rep {rep}: connect {:.0} handshake {:.0} add {:.0} release {:.0} get {:.0} total {:.0} ms",
                            p.connect, p.handshake, p.add, p.release, p.get, p.total()
                        );
                        totals[i].push(p.total());
                        posts[i].push(p.post_connect());
                    }
                    Err(e) => {
                        eprintln!("{name}: {e}");
                        notes[i] = e;
                    }
                }
                // let the sockets of this round close before the next server's round
                thread::sleep(Duration::from_millis(300));
            }
        }
        let failed_note = |i: usize| {
            if notes[i].is_empty() {
                String::new()
            } else {
                format!("{}: some reps failed", names[i])
            }
        };
        rows.push(Row {
            label: format!("rendezvous {n}: total ms"),
            higher_is_better: false,
            cells: totals.into_iter().map(median).collect(),
            note: (0..names.len())
                .map(failed_note)
                .filter(|s| !s.is_empty())
                .collect(),
        });
        rows.push(Row {
            label: format!("rendezvous {n}: post-connect ms"),
            higher_is_better: false,
            cells: posts.into_iter().map(median).collect(),
            note: vec![],
        });
    }

    let mut out = String::new();
    let _ = write!(out, "| measurement |");
    for n in &names {
        let _ = write!(out, " {n} |");
    }
    let _ = writeln!(out, " {} / {} |", names[0], names[base]);
    let _ = write!(out, "|---|");
    for _ in &names {
        let _ = write!(out, "---:|");
    }
    let _ = writeln!(out, "---:|");
    for row in &rows {
        let _ = write!(out, "| {} |", row.label);
        for v in &row.cells {
            let _ = write!(out, " {} |", fmt_value(*v, row.higher_is_better));
        }
        let ratio = match (row.cells[0], row.cells[base]) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
            _ => "–".to_owned(),
        };
        let _ = write!(out, " {ratio} |");
        if !row.note.is_empty() {
            let _ = write!(out, " {}", row.note.join("; "));
        }
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "\nops/s and SET/s: higher is better (ratio > 1 favours {}); rendezvous times: lower is better \
         (ratio < 1 favours {}). Every cell is the median of {} repetitions.",
        names[0], names[0], args.reps
    );
    print!("{out}");
    Ok(())
}
