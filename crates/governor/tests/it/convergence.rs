//! Closed-loop tests of adaptive learning on a simulated clock: a governor in front of a
//! simulated origin with hidden limits, driven by eager clients, the way the proxy drives it.
//!
//! The origin behaves like `nthbouncer sandbox`: a hidden concurrency limit (refusals carry
//! `retry-after-ms` = the typical latency) and a hidden rolling-minute request limit announced
//! OpenAI-style (`limit`, `remaining`, `reset` = until the oldest request leaves the window;
//! refusals carry the time until then). Each client always has work: it waits in the pool's
//! queue, and after a refusal it retries when told to. Time is simulated (a discrete-event
//! loop), so minutes run in milliseconds and every run is reproducible.
//!
//! What must hold after a warm-up: goodput is at least 90 % of what the hidden limits allow and
//! fewer than 2 % of the requests that reach the origin meet a 429 (issue #14's bar for an
//! origin that announces nothing; these origins announce their minute, and every scenario here
//! must clear the bar for an announcing origin: 95 % and under 1 %, see `assert_converges`) — and with adaptation off,
//! the same origin refuses a large share (the comparison that makes the first claim mean
//! something).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use nthbouncer_governor::{
    Governor, Outcome, PoolSettings, Priority, RateInfo, Ticket, TryAcquire,
};

/// One-way network delay between the gateway and the origin.
const NET_MS: u64 = 1;

#[derive(Clone, Copy, Debug)]
struct Origin {
    limit: u32,
    rpm: u32,
    latency_ms: u64,
    jitter_ms: u64,
    /// GitHub-style: the minute is a fixed window that refills at once at its end, announced
    /// as `limit`/`remaining`/`reset` (until the window ends) with no window length.
    fixed: bool,
}

#[derive(Clone, Copy, Debug)]
struct Scenario {
    origin: Origin,
    /// The origin changes its hidden limits this long after the start.
    change: Option<(u64, Origin)>,
    clients: u32,
    pool_limit: u32,
    adaptive: bool,
    warmup_ms: u64,
    measure_ms: u64,
    /// A batch of this many calls instead of endless work: the run ends when the last one
    /// succeeded (see [`batch_time`]).
    calls: Option<u64>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    /// Requests that reached the origin.
    requests: u64,
    ok: u64,
    throttled: u64,
}

#[derive(Debug)]
struct Report {
    measured: Counts,
    /// `ok` over what the hidden limits allow in the measured span.
    goodput: f64,
    /// Share of requests reaching the origin that were refused.
    throttled: f64,
    final_limit: u32,
    final_rpm: Option<u32>,
    /// How long a batch of calls took, if the scenario was one.
    batch_ms: Option<u64>,
    /// The origin announced its budget (it has an RPM limit, announced with every answer).
    announced: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A client wants a slot (first try or a retry).
    Try(u32),
    /// The governor asked to be woken.
    Wake,
    /// A request reaches the origin.
    Arrive(u128),
    /// The origin finished a request and frees its slot.
    Finish(u128),
    /// An answer reaches the gateway.
    Answer(u128),
}

struct Sim {
    s: Scenario,
    g: Governor,
    now: u64,
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
    rng: u64,
    next_id: u128,
    /// Ticket id -> client.
    owner: HashMap<u128, u32>,
    /// Answers on their way back: id -> (status, retry hint, rate).
    answers: HashMap<u128, (u16, Option<u64>, Option<RateInfo>)>,
    origin_in_flight: u32,
    /// Accepted admission times inside the rolling minute.
    window: VecDeque<u64>,
    wake_at: Option<u64>,
    total: Counts,
    at_warmup: Counts,
    /// Calls started so far (a retry after a 429 is the same call).
    started: u64,
    /// When the batch's last call succeeded.
    done_at: Option<u64>,
}

impl Sim {
    fn new(s: Scenario) -> Self {
        let g = Governor::new(PoolSettings {
            limit: s.pool_limit,
            queue_size: 10_000,
            adaptive: s.adaptive,
            lease_term_ms: 120_000,
            request_timeout_ms: 120_000,
            ..PoolSettings::default()
        });
        let mut sim = Sim {
            s,
            g,
            now: 1_000_000,
            events: BinaryHeap::new(),
            seq: 0,
            rng: 0x9E37_79B9_7F4A_7C15,
            next_id: 1,
            owner: HashMap::new(),
            answers: HashMap::new(),
            origin_in_flight: 0,
            window: VecDeque::new(),
            wake_at: None,
            total: Counts::default(),
            at_warmup: Counts::default(),
            started: 0,
            done_at: None,
        };
        for c in 0..s.clients {
            if sim.s.calls.is_none_or(|calls| sim.started < calls) {
                sim.started += 1;
                sim.at(sim.now, Event::Try(c));
            }
        }
        sim
    }

    fn rand(&mut self, bound: u64) -> u64 {
        // xorshift64*: deterministic and good enough for jitter.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D) % bound.max(1)
    }

    fn at(&mut self, t: u64, e: Event) {
        self.seq += 1;
        self.events.push(Reverse((t, self.seq, e)));
    }

    fn run(mut self) -> Report {
        let start = self.now;
        let warm = start + self.s.warmup_ms;
        let end = warm + self.s.measure_ms;
        let mut warmed = false;
        while let Some(Reverse((t, _, e))) = self.events.pop() {
            if let Some((after, origin)) = self.s.change {
                if t >= start + after {
                    self.s.origin = origin;
                    self.s.change = None;
                }
            }
            if !warmed && t >= warm {
                warmed = true;
                self.at_warmup = self.total;
            }
            if t >= end || self.done_at.is_some() {
                break;
            }
            if std::env::var_os("SIM_TRACE").is_some() && t / 30_000 != self.now / 30_000 {
                let snap = self.g.snapshot(t);
                eprintln!(
                    "t={:>5}s ok={:>6} 429={:>6} limit={} rpm={:?} paused={:?} last={:?}",
                    (t - start) / 1_000,
                    self.total.ok,
                    self.total.throttled,
                    snap.effective_limit,
                    snap.learned_rpm,
                    snap.paused_until.map(|p| p - t),
                    snap.last_throttle.map(|l| ((t - l.at) / 1000, l.cause))
                );
            }
            self.now = t;
            self.handle(e);
            self.schedule_wake();
        }
        let m = Counts {
            requests: self.total.requests - self.at_warmup.requests,
            ok: self.total.ok - self.at_warmup.ok,
            throttled: self.total.throttled - self.at_warmup.throttled,
        };
        let o = self.s.origin;
        let secs = self.s.measure_ms as f64 / 1_000.0;
        let by_concurrency = if o.limit > 0 {
            f64::from(o.limit) / ((o.latency_ms as f64 + o.jitter_ms as f64 / 2.0) / 1_000.0)
        } else {
            f64::INFINITY
        };
        let by_rpm = if o.rpm > 0 {
            f64::from(o.rpm) / 60.0
        } else {
            f64::INFINITY
        };
        let capacity = by_concurrency.min(by_rpm) * secs;
        let snap = self.g.snapshot(end);
        Report {
            batch_ms: self.done_at.map(|t| t - start),
            announced: o.rpm > 0,
            measured: m,
            goodput: m.ok as f64 / capacity,
            throttled: m.throttled as f64 / m.requests.max(1) as f64,
            final_limit: snap.effective_limit,
            final_rpm: snap.learned_rpm,
        }
    }

    fn handle(&mut self, e: Event) {
        match e {
            Event::Try(client) => {
                let id = self.next_id;
                self.next_id += 1;
                let ticket = Ticket {
                    id,
                    fairness_key: u64::from(client),
                    priority: Priority::Normal,
                    lease_ms: 120_000,
                    grace_ms: 0,
                };
                match self.g.try_acquire(self.now, ticket, true) {
                    TryAcquire::Admitted(_) => {
                        self.owner.insert(id, client);
                        self.at(self.now + NET_MS, Event::Arrive(id));
                    }
                    TryAcquire::Queued => {
                        self.owner.insert(id, client);
                    }
                    TryAcquire::Refused { retry_after_ms, .. } => {
                        let wait = retry_after_ms.unwrap_or(100).max(1);
                        self.at(self.now + wait, Event::Try(client));
                    }
                }
            }
            Event::Wake => {
                self.wake_at = None;
                self.drain();
            }
            Event::Arrive(id) => self.arrive(id),
            Event::Finish(id) => {
                self.origin_in_flight -= 1;
                self.at(self.now + NET_MS, Event::Answer(id));
            }
            Event::Answer(id) => {
                let (status, retry, rate) = self.answers.remove(&id).unwrap();
                let outcome = Outcome {
                    status: Some(status),
                    throttled: u32::from(status == 429),
                    retry_after_ms: retry,
                    rate,
                    via: Some("proxy"),
                    dialect: rate.map(|_| {
                        if self.s.origin.fixed {
                            "github"
                        } else {
                            "openai"
                        }
                    }),
                };
                self.g.observe_held(self.now, id, &outcome);
                assert!(self.g.release(self.now, id));
                let client = self.owner.remove(&id).unwrap();
                // An eager client: straight back after a success, after the hint after a 429.
                let back = if status == 429 {
                    retry.unwrap_or(100)
                } else {
                    0
                };
                if status == 429 {
                    self.at(self.now + back, Event::Try(client));
                } else if let Some(calls) = self.s.calls {
                    if self.total.ok >= calls {
                        self.done_at = Some(self.now);
                    } else if self.started < calls {
                        self.started += 1;
                        self.at(self.now, Event::Try(client));
                    }
                } else {
                    self.at(self.now + back, Event::Try(client));
                }
                self.drain();
            }
        }
    }

    /// The sandbox's admission: RPM first, then concurrency.
    fn arrive(&mut self, id: u128) {
        let o = self.s.origin;
        self.total.requests += 1;
        if o.fixed {
            // Every admission in the window counts until the window ends, all at once.
            let window_start = self.now / 60_000 * 60_000;
            self.window.retain(|&t| t >= window_start);
        } else {
            while self.window.front().is_some_and(|&t| t + 60_000 <= self.now) {
                self.window.pop_front();
            }
        }
        let until_oldest_leaves = |w: &VecDeque<u64>, now: u64| {
            if o.fixed {
                60_000 - now % 60_000
            } else {
                w.front().map_or(0, |&t| (t + 60_000).saturating_sub(now))
            }
        };
        let rate = |w: &VecDeque<u64>, now: u64| {
            (o.rpm > 0).then(|| RateInfo {
                limit: Some(u64::from(o.rpm)),
                remaining: Some(u64::from(o.rpm).saturating_sub(w.len() as u64)),
                reset_ms: Some(until_oldest_leaves(w, now)),
                // What the proxy implies for OpenAI-style headers; GitHub's say nothing.
                window_ms: (!o.fixed).then_some(60_000),
                ..RateInfo::default()
            })
        };
        if o.rpm > 0 && self.window.len() >= o.rpm as usize {
            self.total.throttled += 1;
            let retry = until_oldest_leaves(&self.window, self.now).max(1);
            let r = rate(&self.window, self.now);
            self.answers.insert(id, (429, Some(retry), r));
            self.at(self.now + NET_MS, Event::Answer(id));
            return;
        }
        if o.limit > 0 && self.origin_in_flight >= o.limit {
            self.total.throttled += 1;
            let retry = o.latency_ms + o.jitter_ms / 2;
            let r = rate(&self.window, self.now);
            self.answers.insert(id, (429, Some(retry.max(1)), r));
            self.at(self.now + NET_MS, Event::Answer(id));
            return;
        }
        if o.rpm > 0 {
            self.window.push_back(self.now);
        }
        self.origin_in_flight += 1;
        self.total.ok += 1;
        let r = rate(&self.window, self.now);
        self.answers.insert(id, (200, None, r));
        let latency = o.latency_ms + self.rand(o.jitter_ms + 1);
        self.at(self.now + latency, Event::Finish(id));
    }

    fn drain(&mut self) {
        while let Some(a) = self.g.dispatch(self.now) {
            self.at(self.now + NET_MS, Event::Arrive(a.id));
        }
    }

    /// The ticker: one pending wake-up at the governor's next wake-up time.
    fn schedule_wake(&mut self) {
        if let Some(t) = self.g.next_wakeup(self.now) {
            let t = t.max(self.now + 1);
            if self.wake_at.is_none_or(|w| t < w) {
                self.wake_at = Some(t);
                self.at(t, Event::Wake);
            }
        }
    }
}

fn run(s: Scenario) -> Report {
    let r = Sim::new(s).run();
    eprintln!("{s:?}\n  -> {r:?}");
    r
}

const SANDBOX: Origin = Origin {
    limit: 8,
    rpm: 300,
    latency_ms: 1_000,
    jitter_ms: 400,
    fixed: false,
};

fn scenario(origin: Origin, adaptive: bool) -> Scenario {
    Scenario {
        origin,
        change: None,
        clients: 100,
        pool_limit: 64,
        adaptive,
        warmup_ms: 60_000,
        measure_ms: 600_000,
        calls: None,
    }
}

/// Issue #14's bar: at least 95 % of capacity with under 1 % of origin answers 429 when the
/// origin announces its budget, 90 % and 2 % when it announces nothing.
fn assert_converges(r: &Report) {
    let (goodput, throttled) = if r.announced {
        (0.95, 0.01)
    } else {
        (0.90, 0.02)
    };
    assert!(r.measured.requests > 0, "{r:?}");
    assert!(
        r.goodput >= goodput,
        "goodput {:.3} < {goodput}: {r:?}",
        r.goodput
    );
    assert!(
        r.throttled < throttled,
        "{:.3} of requests met a 429: {r:?}",
        r.throttled
    );
}

/// The benchmark's scenario: hidden concurrency 8 and 300 RPM (the binding one), pool at 64.
#[test]
fn learns_the_hidden_rpm_and_concurrency_of_a_sandbox_like_origin() {
    let on = run(scenario(SANDBOX, true));
    assert_converges(&on);
    // The announced budget is mirrored, not paced; concurrency is what the pool learned.
    assert_eq!(on.final_rpm, None);
    assert!((7..=9).contains(&on.final_limit), "{on:?}");
    let off = run(scenario(SANDBOX, false));
    assert!(off.throttled > 0.5, "{off:?}");
}

/// Concurrency binds: fast answers, no RPM limit.
#[test]
fn learns_a_hidden_concurrency_limit() {
    let origin = Origin {
        limit: 8,
        rpm: 0,
        latency_ms: 200,
        jitter_ms: 100,
        fixed: false,
    };
    let on = run(scenario(origin, true));
    assert_converges(&on);
    assert!((7..=9).contains(&on.final_limit), "{on:?}");
    let off = run(scenario(origin, false));
    assert!(off.throttled > 0.5, "{off:?}");
}

/// An RPM limit with fast answers: the mirrored budget, not the concurrency limit, must do the
/// work.
#[test]
fn learns_an_announced_rpm_with_fast_answers() {
    let origin = Origin {
        limit: 0,
        rpm: 120,
        latency_ms: 50,
        jitter_ms: 20,
        fixed: false,
    };
    let on = run(scenario(origin, true));
    assert_converges(&on);
    assert_eq!(on.final_limit, 64, "concurrency never bound: {on:?}");
}

/// Long answers (an LLM), concurrency binding, few requests per probe period.
#[test]
fn learns_concurrency_behind_slow_answers() {
    let origin = Origin {
        limit: 4,
        rpm: 0,
        latency_ms: 8_000,
        jitter_ms: 4_000,
        fixed: false,
    };
    let on = run(Scenario {
        warmup_ms: 120_000,
        ..scenario(origin, true)
    });
    assert_converges(&on);
}

/// The origin's limits change during the day: down, then up. The pool follows both ways (down
/// by halving, up by probing), and each time it is back at 90 % within the warm-up.
#[test]
fn follows_a_hidden_limit_that_changes() {
    let before = Origin {
        limit: 8,
        rpm: 0,
        latency_ms: 200,
        jitter_ms: 100,
        fixed: false,
    };
    let lower = Origin { limit: 3, ..before };
    let down = run(Scenario {
        change: Some((300_000, lower)),
        warmup_ms: 360_000,
        ..scenario(before, true)
    });
    assert_converges(&down);
    assert!((2..=4).contains(&down.final_limit), "{down:?}");
    let higher = Origin {
        limit: 16,
        ..before
    };
    let up = run(Scenario {
        change: Some((300_000, higher)),
        warmup_ms: 420_000,
        ..scenario(before, true)
    });
    assert_converges(&up);
    assert!((14..=17).contains(&up.final_limit), "{up:?}");
}

/// The announced limit changes: the mirrored budget follows the announcements at once.
#[test]
fn follows_an_announced_rpm_that_changes() {
    let before = Origin {
        limit: 0,
        rpm: 600,
        latency_ms: 100,
        jitter_ms: 50,
        fixed: false,
    };
    let down = run(Scenario {
        change: Some((300_000, Origin { rpm: 200, ..before })),
        warmup_ms: 420_000,
        ..scenario(before, true)
    });
    assert_converges(&down);
    assert_eq!(down.final_rpm, None, "a budget is mirrored, not paced");
}

/// A fixed window that says only how much is left until it ends (GitHub style): what is left
/// is spent at once, then the pool waits for the reset (the window refills whole).
#[test]
fn spends_a_fixed_window_then_waits_for_its_reset() {
    let origin = Origin {
        limit: 0,
        rpm: 300,
        latency_ms: 100,
        jitter_ms: 50,
        fixed: true,
    };
    let on = run(scenario(origin, true));
    assert_converges(&on);
}

/// A batch of `calls` sent at once by as many clients through a pool of `pool_limit`: how long
/// it takes, its ideal (the origin's concurrency, or the pool's if lower, at the mean answer
/// time; the batch fits the announced budget), and the share of origin answers that were 429s.
fn batch_time(origin: Origin, pool_limit: u32, calls: u64) -> (u64, f64, Report) {
    let r = run(Scenario {
        clients: u32::try_from(calls).unwrap(),
        pool_limit,
        warmup_ms: 0,
        calls: Some(calls),
        ..scenario(origin, true)
    });
    let slots = pool_limit.min(origin.limit) as f64;
    let answer_ms = (NET_MS * 2 + origin.latency_ms) as f64 + origin.jitter_ms as f64 / 2.0;
    let ideal = (calls as f64 / slots).ceil() * answer_ms;
    let took = r.batch_ms.unwrap();
    (took, ideal, r)
}

/// The demo: 80 chat calls through a pool of 4 in front of an origin announcing
/// 600 RPM (hidden concurrency 8, 200 ms answers). The budget (600) has room for all 80, so
/// the pool must not hold any of them back: the batch takes what the pool's 4 slots take.
#[test]
fn spends_an_announced_budget_that_has_room() {
    let origin = Origin {
        limit: 8,
        rpm: 600,
        latency_ms: 200,
        jitter_ms: 0,
        fixed: false,
    };
    let (took, ideal, r) = batch_time(origin, 4, 80);
    eprintln!(
        "80 calls: {took} ms, ideal {ideal} ms, goodput {:.3}",
        ideal / took as f64
    );
    assert_eq!(r.measured.throttled, 0, "{r:?}");
    assert!(
        ideal / took as f64 >= 0.95,
        "{took} ms for 80 calls, ideal {ideal} ms"
    );
}
