//! Pools' own listeners (`[[pools]] listen`, SPEC §1): which pool listens where. It binds the
//! sockets (so a create or update that cannot listen fails before anything changes) and hands
//! each bound listener to the serving side (`app::serve`), which accepts on it until the pool
//! stops listening there or the server stops. It must not serve connections itself.

use std::collections::HashMap;
use std::net::SocketAddr;

use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// A socket bound for a pool, not yet serving.
pub struct Bound {
    listener: TcpListener,
    addr: SocketAddr,
}

impl Bound {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// A pool's listener handed to the serving side: accept on `listener` for `pool` until `stop`.
pub struct Opened {
    pub pool: String,
    pub listener: TcpListener,
    pub stop: CancellationToken,
}

pub struct Listeners {
    open: Mutex<HashMap<String, (SocketAddr, CancellationToken)>>,
    to_serve: mpsc::UnboundedSender<Opened>,
    /// Taken once by the serving side.
    opened: Mutex<Option<mpsc::UnboundedReceiver<Opened>>>,
}

impl Default for Listeners {
    fn default() -> Self {
        let (to_serve, opened) = mpsc::unbounded_channel();
        Listeners {
            open: Mutex::new(HashMap::new()),
            to_serve,
            opened: Mutex::new(Some(opened)),
        }
    }
}

impl Listeners {
    /// Binds `addr` (with `SO_REUSEADDR`, like the main listener).
    pub fn bind(addr: SocketAddr) -> std::io::Result<Bound> {
        let socket = if addr.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        let listener = socket.listen(1024)?;
        let addr = listener.local_addr()?;
        Ok(Bound { listener, addr })
    }

    /// Serves `pool` on `bound` from now on, in place of any listener it had.
    pub fn serve(&self, pool: &str, bound: Bound) {
        let stop = CancellationToken::new();
        let previous = self
            .open
            .lock()
            .insert(pool.to_string(), (bound.addr, stop.clone()));
        if let Some((_, previous)) = previous {
            previous.cancel();
        }
        // Sent before the serving side took its receiver: it finds it queued.
        let _ = self.to_serve.send(Opened {
            pool: pool.to_string(),
            listener: bound.listener,
            stop,
        });
    }

    /// Stops serving `pool` on its own listener (the socket closes; connections it accepted
    /// run to their end).
    pub fn close(&self, pool: &str) {
        if let Some((_, stop)) = self.open.lock().remove(pool) {
            stop.cancel();
        }
    }

    /// Where `pool` listens, if it has its own listener.
    pub fn addr(&self, pool: &str) -> Option<SocketAddr> {
        self.open.lock().get(pool).map(|(addr, _)| *addr)
    }

    /// The listeners to serve, for the serving side (once).
    pub fn take_opened(&self) -> Option<mpsc::UnboundedReceiver<Opened>> {
        self.opened.lock().take()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_pool_listens_on_one_address_at_a_time() {
        let listeners = Listeners::default();
        let mut opened = listeners.take_opened().unwrap();
        let first = Listeners::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let first_addr = first.addr();
        listeners.serve("p", first);
        let a = opened.recv().await.unwrap();
        assert_eq!(
            (a.pool.as_str(), listeners.addr("p")),
            ("p", Some(first_addr))
        );
        // Binding the same address again fails while it is open.
        assert!(Listeners::bind(first_addr).is_err());
        let second = Listeners::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        listeners.serve("p", second);
        assert!(a.stop.is_cancelled(), "the first listener is stopped");
        let b = opened.recv().await.unwrap();
        listeners.close("p");
        assert!(b.stop.is_cancelled());
        assert_eq!(listeners.addr("p"), None);
    }
}
