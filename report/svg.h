// report/svg.h — the one place the pictures' SVG text is written: the document, escaping, the
// elements they share, and the axes of a chart (tally's three pictures: the memory timeline,
// report/timeline.h; the pipeline schedule, report/schedule.h; the sweep, report/sweep.h).
//
// Coordinates are written as the pictures always wrote them: a whole number of pixels (an int) as
// it is, any other (a double) to a tenth of a pixel. Text content and titles are escaped here;
// `attributes` are written as given (a picture's own constants).
#pragma once
#include <concepts>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace tally::report::svg {

// `s` as SVG/XML text: & < > " replaced by entities.
std::string escape(std::string_view s);

// A coordinate or length: an int as it is, a double to one decimal.
template <class T>
  requires std::integral<T> || std::floating_point<T>
std::string num(T v) {
  if constexpr (std::integral<T>) return fmt::format("{}", v);
  else return fmt::format("{:.1f}", v);
}

// The document: the opening tag of a `width` x `height` picture (the viewBox the same), with a
// font family at 12 px for its text when one is given; kEnd closes it.
std::string begin(int width, int height, std::string_view font_family = {});
inline constexpr std::string_view kEnd = "</svg>\n";
// A white background under everything: the picture's size, or "100%" of it when none is given.
std::string background(int width, int height);
std::string background();

// <text x y attributes>content</text>, the content escaped.
std::string text(auto x, auto y, std::string_view attributes, std::string_view content) {
  return fmt::format("<text x=\"{}\" y=\"{}\"{}{}>{}</text>\n", num(x), num(y), attributes.empty() ? "" : " ",
                     attributes, escape(content));
}
// <line x1 y1 x2 y2 attributes/>; with a title, <line ...><title>title</title></line> (shown on hover).
std::string line(auto x1, auto y1, auto x2, auto y2, std::string_view attributes) {
  return fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" {}/>\n", num(x1), num(y1), num(x2), num(y2),
                     attributes);
}
std::string line(auto x1, auto y1, auto x2, auto y2, std::string_view attributes, std::string_view title) {
  return fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" {}><title>{}</title></line>\n", num(x1), num(y1),
                     num(x2), num(y2), attributes, escape(title));
}
// <rect x y width height attributes/>.
std::string rect(auto x, auto y, auto width, auto height, std::string_view attributes) {
  return fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" {}/>\n", num(x), num(y), num(width),
                     num(height), attributes);
}

// ---- the axes of a chart whose plot is the box (left, top) of width x height ------------------
// The two axes: up the left side and along the bottom.
std::string axes(int left, int top, int width, int height);
// A value on the vertical axis: a grey grid line across the plot at `y` and its label left of it.
std::string y_tick(int left, int width, double y, std::string_view label);
// The vertical axis's title, turned to read upwards, centred on `y` at `x`.
std::string y_title(int x, int y, std::string_view title);
// A label centred under the plot: a value on the horizontal axis, or its title.
std::string x_label(auto x, int y, std::string_view label) { return text(x, y, "text-anchor=\"middle\"", label); }

}  // namespace tally::report::svg
