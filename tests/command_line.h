// tests/command_line.h — what the tests that start `tally` (and `mpirun`) themselves share: running
// a command, the mpirun prefix of two ranks, a fresh folder, and two saved state dicts compared.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/safetensors.h"
#include "tests/model_common.h"

namespace tally::test {

inline int run_command(const std::string& command) {
  std::cout << "$ " << command << "\n";
  return std::system(command.c_str());
}

// `mpiexec` with two ranks of one thread each, as root too, more ranks than cores allowed.
inline std::string mpirun_two(const std::string& mpiexec, int timeout_seconds) {
  return fmt::format("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 timeout {} {} "
                     "--oversubscribe -np 2",
                     timeout_seconds, mpiexec);
}

inline std::filesystem::path fresh_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Every tensor of `got` against `want` (same names, shapes; float32 ones within `tolerance`, relative,
// per tensor); returns the worst difference.
inline double compare_state_dicts(const std::filesystem::path& want, const std::filesystem::path& got, double tolerance) {
  const auto a = safetensors::read(want.string()), b = safetensors::read(got.string());
  EXPECT_EQ(a.tensors.size(), b.tensors.size());
  double worst = 0;
  for (const auto& [name, e] : a.tensors) {
    if (!b.tensors.count(name)) {
      ADD_FAILURE() << name << " missing from " << got;
      continue;
    }
    EXPECT_EQ(e.shape, b.tensors.at(name).shape) << name;
    if (e.dtype != "F32") continue;
    const auto x = safetensors::as_f32(e), y = safetensors::as_f32(b.tensors.at(name));
    const double err = rel_error(std::vector<double>(y.begin(), y.end()), std::vector<double>(x.begin(), x.end()));
    worst = std::max(worst, err);
    EXPECT_LE(err, tolerance) << name;
  }
  return worst;
}

}  // namespace tally::test
