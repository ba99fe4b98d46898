// apps/main.cpp — `tally`: the command line of apps/command_line.h, for the zoo's models and the
// families of models/ (registered by name first: seresnet50, resnext50_32x4d, resnetv2_18).
#include "apps/command_line.h"
#include "models/families.h"

int main(int argc, char** argv) {
  tally::models::register_families();
  return tally::app::command_line(argc, argv);
}
