// report/assets.h — the files of report/assets/, compiled in: the memory report page's HTML
// template, styles and script (report/memory_html.h fills the template). The build turns each file
// into a generated source holding its bytes (cmake/embed_asset.cmake, run again whenever the file
// changes), so the program needs nothing beside itself to write the page.
#pragma once
#include <string_view>

namespace tally::report::assets {

extern const std::string_view memory_html;  // report/assets/memory.html: the page, with slots {{name}}
extern const std::string_view memory_css;   // report/assets/memory.css
extern const std::string_view memory_js;    // report/assets/memory.js

}  // namespace tally::report::assets
