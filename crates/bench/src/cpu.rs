//! CPU time a server process spent, read from `/proc`, so each benchmark can report the server's
//! CPU cost per operation next to its throughput. On a shared machine throughput moves with
//! whatever else runs; CPU per operation moves much less, so it is the steadier efficiency ratio.

use std::time::Duration;

use crate::BoxError;

/// `utime + stime` (in clock ticks) and the parent pid of one process.
fn stat(pid: u32) -> Option<(u64, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may itself contain spaces or parentheses: the
    // fixed fields start after the last ')'. There, index 0 is the state (field 3 of proc(5)),
    // so the ppid (field 4) is index 1, utime (14) index 11 and stime (15) index 12.
    let rest = text.get(text.rfind(')')? + 1..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ppid = fields.get(1)?.parse().ok()?;
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime, ppid))
}

/// A process whose CPU time is measured together with its live child processes (nginx's
/// workers are children of the master we started).
#[derive(Clone, Copy)]
pub struct Probe {
    pid: u32,
    ticks_per_second: u64,
}

impl Probe {
    pub fn new(pid: u32, ticks_per_second: u64) -> Result<Probe, BoxError> {
        if stat(pid).is_none() {
            return Err(format!("no process {pid} to measure").into());
        }
        Ok(Probe {
            pid,
            ticks_per_second: ticks_per_second.max(1),
        })
    }

    /// CPU time so far of the process and its children.
    pub fn cpu(&self) -> Duration {
        let mut ticks = stat(self.pid).map_or(0, |(t, _)| t);
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for entry in dir.flatten() {
                let child = entry
                    .file_name()
                    .to_str()
                    .and_then(|s| s.parse::<u32>().ok());
                if let Some((t, ppid)) = child.and_then(stat) {
                    if ppid == self.pid {
                        ticks += t;
                    }
                }
            }
        }
        Duration::from_secs_f64(ticks as f64 / self.ticks_per_second as f64)
    }
}

/// CPU time the whole machine spent so far (user, nice, system, irq and softirq of every core,
/// from `/proc/stat`; not idle, I/O wait or steal): for a benchmark whose parts (the servers,
/// the database, Redis, the load) all run on this machine and are measured together.
pub fn machine_cpu(ticks_per_second: u64) -> Option<Duration> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    // user nice system idle iowait irq softirq steal ...
    let busy: u64 = [0, 1, 2, 5, 6]
        .iter()
        .map(|&i| ticks.get(i).copied().unwrap_or(0))
        .sum();
    Some(Duration::from_secs_f64(
        busy as f64 / ticks_per_second.max(1) as f64,
    ))
}

/// Microseconds of CPU per operation, for a table cell.
pub fn per_op(cpu: Duration, ops: u64) -> String {
    if ops == 0 {
        return "-".into();
    }
    format!("{:.1}", cpu.as_secs_f64() * 1e6 / ops as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_own_process_has_a_stat() {
        let me = std::process::id();
        assert!(stat(me).is_some());
        assert!(Probe::new(me, 100).is_ok());
        assert!(Probe::new(u32::MAX, 100).is_err());
    }

    #[test]
    fn the_machine_has_spent_some_cpu() {
        let Some(spent) = machine_cpu(100) else {
            panic!("no /proc/stat to read");
        };
        assert!(spent > Duration::ZERO);
        assert!(machine_cpu(100).is_some_and(|later| later >= spent));
    }

    #[test]
    fn per_op_formats_microseconds() {
        assert_eq!(per_op(Duration::from_millis(10), 1000), "10.0");
        assert_eq!(per_op(Duration::from_millis(10), 0), "-");
    }
}
