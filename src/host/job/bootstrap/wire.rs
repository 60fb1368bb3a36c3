//! Byte layouts of what bootstrap peers send each other: the handshake's answer and verdict, and
//! the frames every link carries after it, with their abort and address-table payloads.
//!
//! This module owns encoding and decoding only (the layouts are drawn in the parent module's
//! documentation). It must never change a socket's settings, never trust a length a peer announced
//! for an allocation, and never panic on malformed input: a decoder returns an error instead.

use crate::job::auth::{ct_eq, hmac_sha256, DIGEST_LEN, NONCE_LEN};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::ops::Range;
use std::time::Duration;

pub(super) const ANSWER_LEN: usize = DIGEST_LEN + 8 + 8 + 2 + NONCE_LEN;
const VERDICT_HEAD_LEN: usize = 1 + 8 + 8 + 4;
const MAX_REASON_LEN: usize = 4096;
const HEADER_LEN: usize = 24;
/// Frames up to this size are copied behind their header and written with one call.
const SMALL_FRAME: usize = 64 * 1024;
const NO_RANK: u64 = u64::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    User = 1,
    Gather = 2,
    Table = 3,
    Abort = 4,
    Goodbye = 5,
    Heartbeat = 6,
    Shrink = 7,
}

impl Kind {
    fn from_u32(v: u32) -> Option<Kind> {
        Some(match v {
            1 => Kind::User,
            2 => Kind::Gather,
            3 => Kind::Table,
            4 => Kind::Abort,
            5 => Kind::Goodbye,
            6 => Kind::Heartbeat,
            7 => Kind::Shrink,
            _ => return None,
        })
    }
}

fn encode_header(kind: Kind, tag: u64, len: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&(kind as u32).to_le_bytes());
    h[8..16].copy_from_slice(&tag.to_le_bytes());
    h[16..24].copy_from_slice(&len.to_le_bytes());
    h
}

fn decode_header(h: &[u8; HEADER_LEN]) -> io::Result<(Kind, u64, u64)> {
    let word = |r: Range<usize>| {
        let mut b = [0u8; 8];
        b[..r.len()].copy_from_slice(&h[r]);
        u64::from_le_bytes(b)
    };
    let raw_kind = word(0..4) as u32;
    let kind = Kind::from_u32(raw_kind).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unknown frame kind {raw_kind}"),
        )
    })?;
    if word(4..8) != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "nonzero reserved header field",
        ));
    }
    Ok((kind, word(8..16), word(16..24)))
}

/// Bytes of the tag behind every frame's payload.
pub(super) const TAG_LEN: usize = 16;

/// The key of one connection's frames, from the secret and both handshake nonces (so no two
/// connections, of this job or another, share one).
pub(super) fn frame_key(
    secret: &[u8],
    connector_nonce: &[u8],
    listener_nonce: &[u8],
) -> [u8; DIGEST_LEN] {
    hmac_sha256(
        secret,
        &[
            b"doorbell-bootstrap-v3-frames",
            listener_nonce,
            connector_nonce,
        ],
    )
}

/// One direction of a connection's frames: the key, the sending rank and the number of frames
/// sent so far. A frame's tag covers all three, its header and its payload, so a frame that was
/// altered, replayed, reordered, dropped from the middle, or reflected back to its sender fails.
pub(super) struct Seal {
    key: [u8; DIGEST_LEN],
    from: u64,
    next: u64,
}

impl Seal {
    fn tag(&mut self, header: &[u8], payload: &[u8]) -> [u8; TAG_LEN] {
        let full = hmac_sha256(
            &self.key,
            &[
                &self.from.to_le_bytes(),
                &self.next.to_le_bytes(),
                header,
                payload,
            ],
        );
        self.next += 1;
        let mut tag = [0u8; TAG_LEN];
        tag.copy_from_slice(&full[..TAG_LEN]);
        tag
    }
}

/// Writes one frame: header, payload, tag.
pub(super) fn write_frame(
    w: &mut impl Write,
    seal: &mut Seal,
    kind: Kind,
    tag: u64,
    payload: &[u8],
) -> io::Result<()> {
    let header = encode_header(kind, tag, payload.len() as u64);
    let mac = seal.tag(&header, payload);
    if payload.len() <= SMALL_FRAME {
        let mut buf = Vec::with_capacity(HEADER_LEN + payload.len() + TAG_LEN);
        buf.extend_from_slice(&header);
        buf.extend_from_slice(payload);
        buf.extend_from_slice(&mac);
        w.write_all(&buf)
    } else {
        w.write_all(&header)?;
        w.write_all(payload)?;
        w.write_all(&mac)
    }
}

/// Reads one frame and checks its tag.
pub(super) fn read_frame(r: &mut impl Read, seal: &mut Seal) -> io::Result<(Kind, u64, Vec<u8>)> {
    let mut header = [0u8; HEADER_LEN];
    r.read_exact(&mut header)?;
    let (kind, tag, len) = decode_header(&header)?;
    // Grow as bytes arrive rather than trusting `len` for one allocation.
    let mut payload = Vec::with_capacity(len.min(SMALL_FRAME as u64) as usize);
    r.take(len).read_to_end(&mut payload)?;
    if payload.len() as u64 != len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("frame ended after {} of {len} payload bytes", payload.len()),
        ));
    }
    let mut mac = [0u8; TAG_LEN];
    r.read_exact(&mut mac)?;
    if !ct_eq(&mac, &seal.tag(&header, &payload)) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a frame failed authentication (altered, replayed or reordered on the way, or not \
             from this job)",
        ));
    }
    Ok((kind, tag, payload))
}

/// An authenticated bootstrap connection: the socket and both directions' seals. Derefs to the
/// socket for its settings.
pub(super) struct Conn {
    stream: TcpStream,
    send: Seal,
    recv: Seal,
}

impl Conn {
    /// The connection between ranks `me` and `peer` whose handshake gave `key`.
    pub(super) fn new(stream: TcpStream, key: [u8; DIGEST_LEN], me: usize, peer: usize) -> Conn {
        Conn {
            stream,
            send: Seal {
                key,
                from: me as u64,
                next: 0,
            },
            recv: Seal {
                key,
                from: peer as u64,
                next: 0,
            },
        }
    }

    pub(super) fn send(&mut self, kind: Kind, tag: u64, payload: &[u8]) -> io::Result<()> {
        write_frame(&mut self.stream, &mut self.send, kind, tag, payload)
    }

    pub(super) fn recv(&mut self) -> io::Result<(Kind, u64, Vec<u8>)> {
        read_frame(&mut self.stream, &mut self.recv)
    }

    /// The writing half (this socket) and the reading half (a clone of it), each with its seal.
    pub(super) fn split(self) -> io::Result<(Sender, Receiver)> {
        let reader = self.stream.try_clone()?;
        Ok((
            Sender {
                stream: self.stream,
                seal: self.send,
            },
            Receiver {
                stream: reader,
                seal: self.recv,
            },
        ))
    }
}

impl std::ops::Deref for Conn {
    type Target = TcpStream;
    fn deref(&self) -> &TcpStream {
        &self.stream
    }
}

/// The writing half of a [`Conn`].
pub(super) struct Sender {
    stream: TcpStream,
    seal: Seal,
}

impl Sender {
    pub(super) fn send(&mut self, kind: Kind, tag: u64, payload: &[u8]) -> io::Result<()> {
        write_frame(&mut self.stream, &mut self.seal, kind, tag, payload)
    }
}

impl std::ops::Deref for Sender {
    type Target = TcpStream;
    fn deref(&self) -> &TcpStream {
        &self.stream
    }
}

/// The reading half of a [`Conn`].
pub(super) struct Receiver {
    stream: TcpStream,
    seal: Seal,
}

impl Receiver {
    pub(super) fn recv(&mut self) -> io::Result<(Kind, u64, Vec<u8>)> {
        read_frame(&mut self.stream, &mut self.seal)
    }
}

pub(super) fn encode_abort(blamed: Option<usize>, why: &str) -> Vec<u8> {
    let mut p = blamed.map_or(NO_RANK, |r| r as u64).to_le_bytes().to_vec();
    p.extend_from_slice(why.as_bytes());
    p
}

pub(super) fn decode_abort(p: &[u8]) -> (Option<usize>, String) {
    if p.len() < 8 {
        return (None, "malformed abort message".to_string());
    }
    let mut b = [0u8; 8];
    b.copy_from_slice(&p[..8]);
    (
        rank_of(u64::from_le_bytes(b)),
        String::from_utf8_lossy(&p[8..]).into_owned(),
    )
}

fn rank_of(v: u64) -> Option<usize> {
    if v == NO_RANK {
        None
    } else {
        usize::try_from(v).ok()
    }
}

pub(super) fn encode_table(table: &[SocketAddr]) -> Vec<u8> {
    let mut text = String::new();
    for addr in table {
        text.push_str(&addr.to_string());
        text.push('\n');
    }
    text.into_bytes()
}

pub(super) fn decode_table(
    p: &[u8],
    world_size: usize,
) -> std::result::Result<Vec<SocketAddr>, String> {
    let text = std::str::from_utf8(p).map_err(|e| format!("not UTF-8: {e}"))?;
    let table = text
        .lines()
        .map(|l| {
            l.parse::<SocketAddr>()
                .map_err(|e| format!("bad address {l:?}: {e}"))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    if table.len() != world_size {
        return Err(format!("{} entries for {world_size} ranks", table.len()));
    }
    Ok(table)
}

pub(super) struct Answer {
    pub(super) digest: [u8; DIGEST_LEN],
    pub(super) rank: u64,
    pub(super) world_size: u64,
    pub(super) listen_port: u16,
    /// The connector's own challenge: the listener's accept must prove the secret against it.
    pub(super) nonce: [u8; NONCE_LEN],
}

pub(super) fn encode_answer(a: &Answer) -> [u8; ANSWER_LEN] {
    let mut b = [0u8; ANSWER_LEN];
    b[..32].copy_from_slice(&a.digest);
    b[32..40].copy_from_slice(&a.rank.to_le_bytes());
    b[40..48].copy_from_slice(&a.world_size.to_le_bytes());
    b[48..50].copy_from_slice(&a.listen_port.to_le_bytes());
    b[50..].copy_from_slice(&a.nonce);
    b
}

pub(super) fn decode_answer(b: &[u8; ANSWER_LEN]) -> Answer {
    let mut digest = [0u8; DIGEST_LEN];
    digest.copy_from_slice(&b[..32]);
    let u64_at = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[i..i + 8]);
        u64::from_le_bytes(w)
    };
    let mut nonce = [0u8; NONCE_LEN];
    nonce.copy_from_slice(&b[50..]);
    Answer {
        digest,
        rank: u64_at(32),
        world_size: u64_at(40),
        listen_port: u16::from_le_bytes([b[48], b[49]]),
        nonce,
    }
}

#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict<S> {
    /// `proof`: the listener's answer to the connector's challenge (it holds the secret too).
    Accept {
        remaining: Duration,
        proof: [u8; DIGEST_LEN],
    },
    Reject {
        blamed: Option<usize>,
        why: S,
    },
}

pub(super) fn encode_verdict(v: &Verdict<&str>) -> Vec<u8> {
    // An accept carries its proof where a reject carries its reason.
    let (accept, blamed, remaining, why) = match v {
        Verdict::Accept { remaining, proof } => (1u8, None, *remaining, &proof[..]),
        Verdict::Reject { blamed, why } => (0u8, *blamed, Duration::ZERO, why.as_bytes()),
    };
    let why = &why[..why.len().min(MAX_REASON_LEN)];
    let mut b = Vec::with_capacity(VERDICT_HEAD_LEN + why.len());
    b.push(accept);
    b.extend_from_slice(&blamed.map_or(NO_RANK, |r| r as u64).to_le_bytes());
    let ms = u64::try_from(remaining.as_millis()).unwrap_or(u64::MAX);
    b.extend_from_slice(&ms.to_le_bytes());
    b.extend_from_slice(&(why.len() as u32).to_le_bytes());
    b.extend_from_slice(why);
    b
}

pub(super) fn read_verdict(r: &mut impl Read) -> io::Result<Verdict<String>> {
    let mut h = [0u8; VERDICT_HEAD_LEN];
    r.read_exact(&mut h)?;
    let u64_at = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&h[i..i + 8]);
        u64::from_le_bytes(w)
    };
    let len = u32::from_le_bytes([h[17], h[18], h[19], h[20]]) as usize;
    if len > MAX_REASON_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("verdict reason of {len} bytes"),
        ));
    }
    let mut why = vec![0u8; len];
    r.read_exact(&mut why)?;
    match h[0] {
        1 => Ok(Verdict::Accept {
            remaining: Duration::from_millis(u64_at(9)),
            proof: why.as_slice().try_into().map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("an accept with a proof of {len} bytes"),
                )
            })?,
        }),
        0 => Ok(Verdict::Reject {
            blamed: rank_of(u64_at(1)),
            why: String::from_utf8_lossy(&why).into_owned(),
        }),
        other => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("verdict byte {other}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank 0's sending seal and rank 1's receiving one, as a connection between them holds.
    fn seals(key: [u8; DIGEST_LEN]) -> (Seal, Seal) {
        let s = |from| Seal { key, from, next: 0 };
        (s(0), s(0))
    }

    #[test]
    fn frames_round_trip() {
        let (mut tx, mut rx) = seals([7; DIGEST_LEN]);
        let mut wire = Vec::new();
        write_frame(&mut wire, &mut tx, Kind::User, 7, b"hello").unwrap();
        let big = vec![0xabu8; SMALL_FRAME + 5];
        write_frame(&mut wire, &mut tx, Kind::Gather, u64::MAX, &big).unwrap();
        write_frame(&mut wire, &mut tx, Kind::Goodbye, 0, &[]).unwrap();
        let mut r = &wire[..];
        assert_eq!(
            read_frame(&mut r, &mut rx).unwrap(),
            (Kind::User, 7, b"hello".to_vec())
        );
        assert_eq!(
            read_frame(&mut r, &mut rx).unwrap(),
            (Kind::Gather, u64::MAX, big)
        );
        assert_eq!(
            read_frame(&mut r, &mut rx).unwrap(),
            (Kind::Goodbye, 0, vec![])
        );
        let e = read_frame(&mut r, &mut rx).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn altered_replayed_reordered_reflected_or_foreign_frames_fail() {
        let key = frame_key(b"secret", &[1; NONCE_LEN], &[2; NONCE_LEN]);
        let frames = |n: usize| {
            let (mut tx, _) = seals(key);
            (0..n)
                .map(|i| {
                    let mut w = Vec::new();
                    write_frame(&mut w, &mut tx, Kind::User, i as u64, b"abc").unwrap();
                    w
                })
                .collect::<Vec<_>>()
        };
        let fails = |wire: &[u8], rx: &mut Seal| {
            let e = read_frame(&mut &wire[..], rx).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
            assert!(e.to_string().contains("failed authentication"), "{e}");
        };
        let f = frames(2);
        // Altered: a payload byte, the tag, the header's tag field.
        for at in [HEADER_LEN + 1, f[0].len() - 1, 8] {
            let mut bad = f[0].clone();
            bad[at] ^= 1;
            fails(&bad, &mut seals(key).1);
        }
        // Reordered (the second frame first) and replayed (the first frame twice).
        fails(&f[1], &mut seals(key).1);
        let mut rx = seals(key).1;
        read_frame(&mut &f[0][..], &mut rx).unwrap();
        fails(&f[0], &mut rx);
        // Reflected: rank 0's frame fed back to rank 0's own receiving seal (from rank 1).
        fails(
            &f[0],
            &mut Seal {
                key,
                from: 1,
                next: 0,
            },
        );
        // Another connection's key (other nonces), or another job's secret.
        let other = frame_key(b"secret", &[1; NONCE_LEN], &[3; NONCE_LEN]);
        fails(&f[0], &mut seals(other).1);
        let foreign = frame_key(b"other", &[1; NONCE_LEN], &[2; NONCE_LEN]);
        fails(&f[0], &mut seals(foreign).1);
    }

    #[test]
    fn malformed_frames_are_errors_not_allocations() {
        let rx = || seals([0; DIGEST_LEN]).1;
        let mut h = encode_header(Kind::User, 1, 10);
        h[0] = 99;
        let e = read_frame(&mut &h[..], &mut rx()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        let mut h = encode_header(Kind::User, 1, 10);
        h[5] = 1;
        assert!(read_frame(&mut &h[..], &mut rx()).is_err());
        // A huge announced length with a short body ends in EOF, not an allocation failure.
        let mut wire = encode_header(Kind::User, 1, u64::MAX / 2).to_vec();
        wire.extend_from_slice(b"short");
        let e = read_frame(&mut &wire[..], &mut rx()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
    }

    #[test]
    fn abort_and_table_payloads_round_trip() {
        assert_eq!(
            decode_abort(&encode_abort(Some(3), "rank 3 did not join")),
            (Some(3), "rank 3 did not join".to_string())
        );
        assert_eq!(
            decode_abort(&encode_abort(None, "x")),
            (None, "x".to_string())
        );
        assert_eq!(decode_abort(b"abc").0, None);
        let table: Vec<SocketAddr> = vec![
            "0.0.0.0:29500".parse().unwrap(),
            "10.1.2.3:40000".parse().unwrap(),
            "[fe80::1]:41000".parse().unwrap(),
        ];
        assert_eq!(decode_table(&encode_table(&table), 3).unwrap(), table);
        assert!(decode_table(&encode_table(&table), 4).is_err());
        assert!(decode_table(b"not an address\n", 1).is_err());
        assert!(decode_table(&[0xff, 0xfe], 1).is_err());
    }

    #[test]
    fn verdicts_round_trip() {
        let accept = encode_verdict(&Verdict::Accept {
            remaining: Duration::from_millis(1234),
            proof: [7; DIGEST_LEN],
        });
        assert_eq!(
            read_verdict(&mut &accept[..]).unwrap(),
            Verdict::Accept {
                remaining: Duration::from_millis(1234),
                proof: [7; DIGEST_LEN],
            }
        );
        // An accept without a whole proof is malformed.
        let mut short = accept.clone();
        short[17..21].copy_from_slice(&3u32.to_le_bytes());
        short.truncate(VERDICT_HEAD_LEN + 3);
        assert!(read_verdict(&mut &short[..]).is_err());
        let reject = encode_verdict(&Verdict::Reject {
            blamed: Some(5),
            why: "no",
        });
        assert_eq!(
            read_verdict(&mut &reject[..]).unwrap(),
            Verdict::Reject {
                blamed: Some(5),
                why: "no".to_string()
            }
        );
        let long = "x".repeat(MAX_REASON_LEN * 2);
        let capped = encode_verdict(&Verdict::Reject {
            blamed: None,
            why: &long,
        });
        assert_eq!(capped.len(), VERDICT_HEAD_LEN + MAX_REASON_LEN);
        let mut bad = reject.clone();
        bad[0] = 7;
        assert!(read_verdict(&mut &bad[..]).is_err());
    }
}
