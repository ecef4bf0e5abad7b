//! Property tests of `rendezvous::store::protocol` (stable Rust, proptest): every request
//! round-trips, arbitrary bytes never panic the decoder, and how a valid stream is cut into
//! segments never changes what it decodes to.

use bytes::{Bytes, BytesMut};
use proptest::collection::vec;
use proptest::prelude::*;
use rendezvous::store::protocol::{DecodeError, Request};

fn bytes_up_to(n: usize) -> impl Strategy<Value = Bytes> {
    vec(any::<u8>(), 0..=n).prop_map(Bytes::from)
}

fn keys() -> impl Strategy<Value = Vec<Bytes>> {
    vec(bytes_up_to(40), 0..6)
}

/// Every request type of torch 2.15 (all 19 commands).
fn request() -> impl Strategy<Value = Request> {
    let k = || bytes_up_to(40);
    let v = || bytes_up_to(300);
    prop_oneof![
        any::<u32>().prop_map(|magic| Request::Validate { magic }),
        (k(), v()).prop_map(|(key, value)| Request::Set { key, value }),
        (k(), v(), v()).prop_map(|(key, expected, desired)| Request::CompareSet {
            key,
            expected,
            desired
        }),
        k().prop_map(|key| Request::Get { key }),
        (k(), any::<i64>()).prop_map(|(key, delta)| Request::Add { key, delta }),
        keys().prop_map(|keys| Request::Check { keys }),
        keys().prop_map(|keys| Request::Wait { keys }),
        Just(Request::GetNumKeys),
        k().prop_map(|key| Request::DeleteKey { key }),
        (k(), v()).prop_map(|(key, value)| Request::Append { key, value }),
        keys().prop_map(|keys| Request::MultiGet { keys }),
        vec((k(), v()), 0..5).prop_map(|pairs| Request::MultiSet { pairs }),
        Just(Request::CancelWait),
        any::<u32>().prop_map(|nonce| Request::Ping { nonce }),
        (k(), v()).prop_map(|(key, value)| Request::QueuePush { key, value }),
        k().prop_map(|key| Request::QueuePop { key }),
        k().prop_map(|key| Request::QueueLen { key }),
        Just(Request::ListKeys),
        (k(), any::<i64>()).prop_map(|(key, world_size)| Request::Barrier { key, world_size }),
    ]
}

fn encode_all(requests: &[Request]) -> BytesMut {
    let mut out = BytesMut::new();
    for r in requests {
        r.encode(&mut out);
    }
    out
}

/// Decodes everything decodable from `buf`, stopping at the first error or "need more bytes".
fn drain(buf: &mut BytesMut, out: &mut Vec<Request>) -> Result<(), DecodeError> {
    while let Some(r) = Request::decode(buf)? {
        out.push(r);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn every_request_round_trips(req in request()) {
        let mut buf = encode_all(std::slice::from_ref(&req));
        let encoded_len = buf.len();
        prop_assert_eq!(buf[0], req.command().code());
        let decoded = Request::decode(&mut buf).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(decoded.as_ref(), Some(&req));
        prop_assert!(buf.is_empty(), "{} of {} bytes left", buf.len(), encoded_len);
    }

    #[test]
    fn every_proper_prefix_needs_more_bytes(req in request()) {
        let full = encode_all(std::slice::from_ref(&req));
        for cut in 0..full.len() {
            let mut buf = BytesMut::from(&full[..cut]);
            let r = Request::decode(&mut buf);
            prop_assert!(matches!(r, Ok(None)), "prefix {} of {}: {:?}", cut, full.len(), r);
            prop_assert_eq!(buf.len(), cut, "a partial decode consumed bytes");
        }
    }

    #[test]
    fn any_split_of_a_stream_decodes_identically(
        reqs in vec(request(), 1..8),
        cuts in vec(any::<prop::sample::Index>(), 0..12),
    ) {
        let stream = encode_all(&reqs);
        let mut points: Vec<usize> = cuts.iter().map(|i| i.index(stream.len() + 1)).collect();
        points.push(stream.len());
        points.sort_unstable();
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        let mut from = 0;
        for to in points {
            buf.extend_from_slice(&stream[from..to]);
            from = to;
            drain(&mut buf, &mut got).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        prop_assert!(buf.is_empty());
        prop_assert_eq!(got, reqs);
    }

    #[test]
    fn arbitrary_bytes_never_panic(data in vec(any::<u8>(), 0..600), cut in any::<prop::sample::Index>()) {
        // fed whole and in two pieces: either way it ends in requests, an error, or a wait
        for pieces in [vec![&data[..]], { let c = cut.index(data.len() + 1); vec![&data[..c], &data[c..]] }] {
            let mut buf = BytesMut::new();
            let mut out = Vec::new();
            for p in pieces {
                buf.extend_from_slice(p);
                if drain(&mut buf, &mut out).is_err() {
                    break;
                }
            }
        }
    }

    #[test]
    fn arbitrary_bytes_after_a_command_byte_never_panic(code in 0u8..19, data in vec(any::<u8>(), 0..200)) {
        let mut buf = BytesMut::from(&[code][..]);
        buf.extend_from_slice(&data);
        let mut out = Vec::new();
        let _ = drain(&mut buf, &mut out);
    }

    #[test]
    fn hostile_lengths_are_errors_or_waits_never_allocations(code in 0u8..19, len in any::<u64>()) {
        let mut buf = BytesMut::from(&[code][..]);
        buf.extend_from_slice(&len.to_le_bytes());
        let before = buf.len();
        if let Ok(None) = Request::decode(&mut buf) {
            prop_assert_eq!(buf.len(), before);
        }
    }
}

#[test]
fn unknown_codes_are_errors() {
    for code in 19..=u8::MAX {
        let mut buf = BytesMut::from(&[code, 0, 0][..]);
        assert_eq!(
            Request::decode(&mut buf),
            Err(DecodeError::UnknownCommand(code))
        );
    }
}

#[test]
fn limits_are_libuv_s() {
    let cases: [(Vec<u8>, bool); 6] = [
        ([&[3u8][..], &(8 * 1024u64).to_le_bytes()].concat(), true),
        (
            [&[3u8][..], &(8 * 1024u64 + 1).to_le_bytes()].concat(),
            false,
        ),
        (
            [
                &[1u8, 1, 0, 0, 0, 0, 0, 0, 0, b'k'][..],
                &(8u64 << 20).to_le_bytes(),
            ]
            .concat(),
            true,
        ),
        (
            [
                &[1u8, 1, 0, 0, 0, 0, 0, 0, 0, b'k'][..],
                &((8u64 << 20) + 1).to_le_bytes(),
            ]
            .concat(),
            false,
        ),
        ([&[5u8][..], &(128 * 1024u64).to_le_bytes()].concat(), true),
        (
            [&[5u8][..], &(128 * 1024u64 + 1).to_le_bytes()].concat(),
            false,
        ),
    ];
    for (bytes, within) in cases {
        let mut buf = BytesMut::from(&bytes[..]);
        let r = Request::decode(&mut buf);
        assert_eq!(matches!(r, Ok(None)), within, "{bytes:02x?}: {r:?}");
    }
}
