// Stand-in for llama.cpp's web UI: one empty page at / (the API is all a benchmark needs).
#include "ui.h"

static const char index_html[] =
    "<!doctype html><html><head><title>llama-server</title></head>"
    "<body>llama-server built without its web UI; the API is at /v1.</body></html>\n";

const std::array<llama_ui_asset, 1> & llama_ui_get_assets() {
    static const std::array<llama_ui_asset, 1> assets = {{
        {"index.html", reinterpret_cast<const unsigned char *>(index_html), sizeof(index_html) - 1, "\"thin-ui-1\"",
         "text/html; charset=utf-8"},
    }};
    return assets;
}

const llama_ui_asset * llama_ui_find_asset(const std::string & name) {
    for (const auto & a : llama_ui_get_assets()) {
        if (a.name == name) {
            return &a;
        }
    }
    return nullptr;
}

bool llama_ui_use_gzip() { return false; }
