//! Progress bars on stderr, shown only when asked for and stderr is a terminal.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// A bar of `total` steps drawn with indicatif's `template`, or a hidden one when `show` is
/// false or stderr is not a terminal (so logs and pipes stay clean).
pub fn bar(show: bool, total: u64, template: &str) -> ProgressBar {
    if !show || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(template)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar
}
