// Opening a file the program reads as data (a config, a tokenizer, a checkpoint shard or its index).
// Anything but a regular file is refused with an Error naming it, and nothing blocks on the way: a
// FIFO opened for reading waits for a writer that may never come, so the open is non-blocking and the
// file's type is checked before a byte is read. (Prompt-cache entries do the same in disk_cache.cpp.)
#pragma once

#include <string>

namespace dsv41 {

// A read-only descriptor for `path`, which the caller closes. Error "<path>: cannot open: <reason>", or
// "<path>: is a FIFO (a directory, a character device, ...), not a regular file".
int open_regular_file(const std::string& path);

// The whole of a regular file, with the same checks and an Error naming it when a read fails.
std::string read_regular_file(const std::string& path);

}  // namespace dsv41
