// SIGINT/SIGTERM: the first asks long work to drain and stop at the next safe point;
// a second one exits at once (the run stays resumable: only finished shards count).
#pragma once

namespace talon {

void install_stop_handlers();
bool stop_requested();
int stop_signal();  // the signal that asked, 0 if none
void request_stop_for_test();

}  // namespace talon
