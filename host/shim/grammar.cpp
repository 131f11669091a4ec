// llama.cpp's JSON-schema-to-GBNF conversion (common/json-schema-to-grammar.h, C++) behind a C
// function, for structured output: host/src/grammar.rs compiles the grammar it writes with
// llama.h's grammar sampler.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "json-schema-to-grammar.h"
#include "json.h"

// Writes the GBNF grammar of the JSON schema `schema` (JSON text) to `out` (room for `cap`
// bytes, NUL included) and returns its length; a length >= cap means `out` was too small. On
// failure returns -1 with the reason in `err` (room for `err_cap` bytes).
extern "C" int64_t leap_json_schema_to_grammar(const char * schema, char * out, int64_t cap, char * err,
                                               int64_t err_cap) {
    try {
        const std::string g = json_schema_to_grammar(common_json::parse(schema));
        if (out && cap > 0) {
            std::snprintf(out, (size_t) cap, "%s", g.c_str());
        }
        return (int64_t) g.size();
    } catch (const std::exception & e) {
        if (err && err_cap > 0) {
            std::snprintf(err, (size_t) err_cap, "%s", e.what());
        }
        return -1;
    } catch (...) {
        if (err && err_cap > 0) {
            std::snprintf(err, (size_t) err_cap, "%s", "unknown error");
        }
        return -1;
    }
}
