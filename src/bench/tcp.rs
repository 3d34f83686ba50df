//! The encrypted TCP transport, measured beside what bounds it, in one run:
//!
//! - `memcpy`: one copy of the bytes into fresh memory (see [`cases::memcpy`]);
//! - `tcp_plain`: the same bytes over plain, unencrypted TCP on 127.0.0.1 to `n`
//!   receivers at once, each reading into fresh memory (one writer thread per
//!   receiver): the kernel's loopback limit, with no framing and no cipher;
//! - `fanout` (local sockets) and `tcp_fanout`: the executor sends the bytes to `n`
//!   ranks, rank 0 checks them (see [`cases::fanout`]);
//! - `roundtrip_empty` and `tcp_roundtrip_empty`: an empty task on a ready group.
//!
//! Caveat: loopback TCP has no wire: a real network adds its own bandwidth limit
//! (10 GbE is ~1.2 GB/s), usually below the cipher's.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use super::cases::{self, Setup};
use super::report::Figure;

/// Payload sizes: 64 MiB, and 1 GiB unless quick.
fn sizes(big: bool) -> Vec<usize> {
    let mut v = vec![64usize << 20];
    if big {
        v.push(1 << 30);
    }
    v
}

/// Runs every TCP figure, emitting each as soon as it is known.
pub fn run(
    s: &Setup<'_>,
    reps: usize,
    big: bool,
    emit: &mut dyn FnMut(Figure),
) -> anyhow::Result<()> {
    let tcp = Setup {
        program: s.program,
        args: s.args,
        logs: s.logs,
        tcp: true,
    };
    let rounds = if big { 1000 } else { 100 };
    for n in [2, 8] {
        let local = cases::roundtrip(s, n, rounds)?;
        let local_us = local.value;
        emit(local);
        let mut f = cases::roundtrip(&tcp, n, rounds)?;
        f.name = "tcp_roundtrip_empty";
        let ratio = f.value / local_us;
        emit(f.with("ratio_to_local", ratio));
    }
    let fan_reps = reps.min(3);
    for size in sizes(big) {
        let data = cases::payload(size);
        let copy = cases::memcpy(&data, fan_reps);
        let yardstick = copy.value;
        emit(copy);
        for n in [2u32, 8] {
            let plain = plain_tcp(&data, n, fan_reps)?;
            let plain_ms = plain.value;
            emit(plain.with("ratio_to_memcpy", plain_ms / yardstick));
            let local = cases::fanout(s, n, &data, false, fan_reps)?;
            let local_ms = local.value;
            emit(local.with("ratio_to_memcpy", local_ms / yardstick));
            let mut f = cases::fanout(&tcp, n, &data, false, fan_reps)?;
            f.name = "tcp_fanout";
            let v = f.value;
            emit(
                f.with("ratio_to_memcpy", v / yardstick)
                    .with("ratio_to_tcp_plain", v / plain_ms)
                    .with("ratio_to_local", v / local_ms)
                    .with("gbytes_per_s", (n as f64 * size as f64) / (v / 1e3) / 1e9),
            );
        }
    }
    Ok(())
}

/// `data` to `n` receivers over plain TCP on 127.0.0.1, each reading into fresh memory;
/// timed from the first write until every receiver has every byte.
pub fn plain_tcp(data: &[u8], n: u32, reps: usize) -> anyhow::Result<Figure> {
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let len = data.len();
        let receivers: Vec<std::thread::JoinHandle<std::io::Result<usize>>> = (0..n)
            .map(|_| {
                std::thread::spawn(move || {
                    let mut s = TcpStream::connect(addr)?;
                    let mut buf: Vec<u8> = Vec::with_capacity(len);
                    (&mut s).take(len as u64).read_to_end(&mut buf)?;
                    std::hint::black_box(&buf);
                    Ok(buf.len())
                })
            })
            .collect();
        let mut conns = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let (c, _) = listener.accept()?;
            c.set_nodelay(true)?;
            conns.push(c);
        }
        cases::warm_memory(2 * len);
        let t = Instant::now();
        std::thread::scope(|scope| -> anyhow::Result<()> {
            let writers: Vec<_> = conns
                .iter_mut()
                .map(|c| scope.spawn(move || c.write_all(data)))
                .collect();
            for w in writers {
                w.join()
                    .map_err(|_| anyhow::anyhow!("a writer thread panicked"))??;
            }
            Ok(())
        })?;
        for r in receivers {
            let got = r
                .join()
                .map_err(|_| anyhow::anyhow!("a receiver thread panicked"))??;
            anyhow::ensure!(got == len, "a receiver got {got} of {len} bytes");
        }
        samples.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(Figure::new(
        "tcp_plain",
        Some(n),
        Some(data.len() as u64),
        "ms",
        samples,
    ))
}
