// The headers most test drivers include, precompiled once per build folder (CMakeLists.txt,
// dsv41_test_pch) and included ahead of every driver's own. Only headers whose meaning does not
// depend on macros a driver defines: cpp-httplib stays in http_lib.h for that reason.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
