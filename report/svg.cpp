// report/svg.cpp — the pictures' SVG document and axes; see report/svg.h.
#include "report/svg.h"

namespace tally::report::svg {

std::string escape(std::string_view s) {
  std::string o;
  for (char c : s) {
    if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '&') o += "&amp;";
    else if (c == '"') o += "&quot;";
    else o += c;
  }
  return o;
}

std::string begin(int width, int height, std::string_view font_family) {
  const std::string font =
      font_family.empty() ? std::string() : fmt::format(" font-family=\"{}\" font-size=\"12\"", font_family);
  return fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\"{2}>\n", width,
      height, font);
}

std::string background(int width, int height) {
  return fmt::format("<rect width=\"{}\" height=\"{}\" fill=\"white\"/>\n", width, height);
}

std::string background() { return "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"; }

std::string axes(int left, int top, int width, int height) {
  return line(left, top, left, top + height, "stroke=\"black\"") +
         line(left, top + height, left + width, top + height, "stroke=\"black\"");
}

std::string y_tick(int left, int width, double y, std::string_view label) {
  return line(left, y, left + width, y, "stroke=\"#dddddd\"") + text(left - 6, y + 4, "text-anchor=\"end\"", label);
}

std::string y_title(int x, int y, std::string_view title) {
  return text(x, y, fmt::format("transform=\"rotate(-90 {} {})\" text-anchor=\"middle\"", x, y), title);
}

}  // namespace tally::report::svg
