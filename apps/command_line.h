// apps/command_line.h — the `tally` command line as a library function. A program of one's own
// registers its models (nn::register_model, nn/resnet.h) and hands its arguments here, and gets
// `train`, `plan`, `sweep` and `device` for them — run folders, progress, metrics.csv, checkpoints
// and `--resume` bit for bit, the memory report, MPI — as `tally` gives them for the zoo's
// (docs/models.md, "The whole command line for your model"; examples/consumer/my_cli.cpp).
#pragma once

namespace tally::app {

// Parses `argv` as `tally`'s (argv[0] the program), runs the command and returns the process's
// exit status: 0, 1 for an error (printed), 2 for a bad command line, 128 + N for a run stopped by
// signal N (its checkpoint written). At the start it may run the program again once, with
// OpenMP's threads waiting passively, when the machine is loaded (apps/command_line.cpp).
int command_line(int argc, char** argv);

}  // namespace tally::app
