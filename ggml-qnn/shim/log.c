/* QNN's log callback receives a printf format and a va_list, which stable Rust cannot take.
 * This shim formats the message and hands it to the sink Rust registered (src/log.rs). */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

typedef void (*leap_qnn_sink_t)(uint32_t level, const char *message);

static leap_qnn_sink_t leap_qnn_sink;

void leap_qnn_set_log_sink(leap_qnn_sink_t sink) { leap_qnn_sink = sink; }

/* Matches QnnLog_Callback_t: (const char* fmt, QnnLog_Level_t level, uint64_t timestamp, va_list). */
void leap_qnn_log_callback(const char *fmt, uint32_t level, uint64_t timestamp, va_list args) {
    char buf[1024];
    (void)timestamp;
    if (fmt == NULL) return;
    vsnprintf(buf, sizeof buf, fmt, args);
    leap_qnn_sink_t sink = leap_qnn_sink;
    if (sink != NULL) sink(level, buf);
}
