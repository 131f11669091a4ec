//! The model GGUF's header reader ([`leap_host::GgufInfo`], ggml's gguf code underneath), the
//! flash layer map built on it, and the DRAM plans made from that map.
#![no_main]

use leap_flash::{plan, LayerMap, Strategy};
use leap_host::GgufInfo;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = leap_fuzz::scratch("model.gguf", data);
    let Ok(info) = GgufInfo::open(&path) else {
        return;
    };
    // What `leap info` prints.
    let _ = info.architecture();
    for (k, v) in &info.kv {
        let _ = format!("{k} = {v}");
    }
    for t in &info.tensors {
        let _ = t.block();
        assert!(
            t.offset + t.size <= info.file_size,
            "{t:?} outside the file"
        );
    }
    let _ = info.tensor_bytes();

    let map = LayerMap::from_info(&info);
    assert!(map.total() <= info.file_size);
    let _ = (map.per_call_bytes(), map.largest_block(), map.blocks());
    for budget in [0, info.file_size / 2, info.file_size] {
        for strategy in [Strategy::FirstLayers, Strategy::OutputFirst, Strategy::Fill] {
            let p = plan(&map, budget, 1 << 20, 2, strategy);
            assert!(p.pinned_bytes <= budget.max(map.bytes(leap_flash::Section::Rest)));
        }
    }
});
