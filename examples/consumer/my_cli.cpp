// examples/consumer/my_cli.cpp — the whole `tally` command line for a model of one's own: the
// program registers docs/models.md's SmallResNet as "small_resnet" and hands its arguments to
// tally's command line (apps/command_line.h), so `my_cli train --model small_resnet ...` has run
// folders, checkpoints and --resume, `my_cli plan --report`, `my_cli sweep` — everything `tally`
// gives the zoo's models. tests/my_cli.sh runs it in tally's tree and tests/consumer_test.sh against
// the installed package.
#include <memory>

#include "apps/command_line.h"
#include "nn/resnet.h"
#include "small_resnet.h"

int main(int argc, char** argv) {
  // The factory gets the run's model configuration: its input channels and classes (--norm is this
  // model's own business: it always uses batch norm).
  tally::nn::register_model("small_resnet", [](const tally::nn::ModelConfig& c) {
    return std::make_shared<my::SmallResNet>(/*blocks=*/2, c.num_classes, c.in_channels);
  });
  return tally::app::command_line(argc, argv);
}
