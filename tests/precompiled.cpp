// The source the test drivers' precompiled header (precompiled.h) is built with; it compiles nothing else.
