// apps/main.cpp — `tally`: the command line of apps/command_line.h, for the zoo's models.
#include "apps/command_line.h"

int main(int argc, char** argv) { return tally::app::command_line(argc, argv); }
