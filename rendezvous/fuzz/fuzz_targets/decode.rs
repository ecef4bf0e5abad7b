//! Fuzz target `decode`: arbitrary bytes, fed to `Request::decode` whole and cut at a point the
//! input chooses, must never panic; a request that decodes must re-encode to exactly the bytes it
//! was decoded from; and "need more bytes" must consume nothing.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use rendezvous::store::protocol::Request;

fuzz_target!(|data: &[u8]| {
    let Some((&cut, data)) = data.split_first() else {
        return;
    };
    let cut = usize::from(cut) % (data.len() + 1);
    let mut buf = BytesMut::new();
    for piece in [&data[..cut], &data[cut..]] {
        buf.extend_from_slice(piece);
        loop {
            let before = buf.clone();
            match Request::decode(&mut buf) {
                Ok(Some(request)) => {
                    let used = before.len() - buf.len();
                    let mut again = BytesMut::new();
                    request.encode(&mut again);
                    assert_eq!(&again[..], &before[..used], "re-encoding differs");
                }
                Ok(None) => {
                    assert_eq!(buf, before, "a partial decode consumed bytes");
                    break;
                }
                Err(_) => return,
            }
        }
    }
});
