//! The proxy's CPU priority. A proxy beside the broker on the same cores competes with it for
//! CPU; at a lower priority it runs when the broker waits for it, reads more frames per system
//! call (fewer, larger reads and writes) and takes about half the CPU for the same traffic
//! (docs/PERFORMANCE.md, "Through delay-proxy"). Where it has cores of its own, the niceness
//! changes nothing.

use amqp_delay::Result;

/// The niceness `delay-proxy` runs at unless told otherwise (`--niceness`).
pub const DEFAULT_NICENESS: i32 = 10;

/// The highest niceness there is (the lowest priority).
pub const MAX_NICENESS: i32 = 19;

/// Lowers the calling thread's CPU priority to `niceness` (0–19; on Linux a niceness belongs to
/// a thread, and the threads it starts afterwards inherit it). A thread already at that
/// niceness or lower priority is left as it is: raising a priority needs privileges, and an
/// operator's own `nice` wins. Returns the niceness the thread runs at.
pub fn lower_to(niceness: i32) -> Result<i32> {
    if !(0..=MAX_NICENESS).contains(&niceness) {
        return Err(super::config(format!(
            "the niceness must be 0 to {MAX_NICENESS}, not {niceness}"
        )));
    }
    let now = rustix::process::getpriority_process(None)
        .map_err(|e| super::config(format!("reading the CPU priority: {e}")))?;
    if now >= niceness {
        return Ok(now);
    }
    rustix::process::setpriority_process(None, niceness).map_err(|e| {
        super::config(format!(
            "lowering the CPU priority to niceness {niceness}: {e}"
        ))
    })?;
    Ok(niceness)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's niceness as the kernel reports it (`/proc/thread-self/stat`).
    fn kernel_niceness() -> i32 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        // the fields after the command's closing parenthesis; niceness is the 19th field
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        rest.split(' ').nth(16).unwrap().parse().unwrap()
    }

    #[test]
    fn a_thread_is_lowered_once_and_never_raised() {
        let here = kernel_niceness();
        std::thread::spawn(|| {
            let start = kernel_niceness();
            assert_eq!(lower_to(0).unwrap(), start, "0 leaves it");
            let want = DEFAULT_NICENESS.max(start);
            assert_eq!(lower_to(DEFAULT_NICENESS).unwrap(), want);
            assert_eq!(kernel_niceness(), want);
            // asking for less than it has keeps what it has
            assert_eq!(lower_to(want - 1).unwrap(), want);
            assert_eq!(kernel_niceness(), want);
            // a thread it starts inherits it
            let child = std::thread::spawn(kernel_niceness).join().unwrap();
            assert_eq!(child, want);
            let e = lower_to(20).unwrap_err().to_string();
            assert!(e.contains("0 to 19"), "{e}");
            assert!(lower_to(-1).is_err());
        })
        .join()
        .unwrap();
        // only that thread was lowered
        assert_eq!(kernel_niceness(), here);
    }
}
