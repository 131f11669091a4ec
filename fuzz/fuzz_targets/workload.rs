//! `leap bench`'s workload reader (JSON Lines of requests), with and without task filters,
//! `--skip` and `--limit`.
#![no_main]

use std::path::Path;

use leap_cli::bench::workload;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.jsonl");
    let Ok(all) = workload::read(data, path, &[], 0, None) else {
        return;
    };
    let code = ["code".to_string()];
    let some = workload::read(data, path, &code, 1, Some(2)).expect("the same lines parse");
    assert!(some.len() <= 2);
    let kept = all.iter().filter(|r| r.task == "code").count();
    assert_eq!(some.len(), kept.saturating_sub(1).min(2));
});
