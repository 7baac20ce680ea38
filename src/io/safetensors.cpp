#include "io/safetensors.h"

#include <xxhash.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <new>
#include <system_error>

#include <nlohmann/json.hpp>

#include "util/error.h"
#include "util/regular_file.h"

namespace dsv41 {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string errno_text(int err) { return std::generic_category().message(err); }

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

// Closes a descriptor on every exit path of the MappedFile constructor.
struct FdGuard {
  int fd;
  ~FdGuard() { ::close(fd); }
};

}  // namespace

MappedFile::MappedFile(const std::string& path) : path_(path) {
  const int fd = open_regular_file(path);  // a FIFO, folder or device is refused, never waited on
  FdGuard guard{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail(path, "cannot stat: " + errno_text(errno));
  size_ = static_cast<size_t>(st.st_size);
  if (size_ == 0) return;  // mmap rejects length 0; callers see an empty file and report it
  // MAP_PRIVATE + PROT_READ: the checkpoint is never written through the mapping. The mapping stays
  // valid after the descriptor is closed. (A file truncated by someone else while mapped would raise
  // SIGBUS on access; that cannot be checked up front.)
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED) fail(path, "cannot mmap " + std::to_string(size_) + " bytes: " + errno_text(errno));
  data_ = static_cast<const uint8_t*>(p);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

int64_t TensorView::numel() const {
  int64_t n = 1;  // the header parser guarantees the product fits in int64
  for (int64_t d : info->shape) n *= d;
  return n;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : map_(path) {
  SafetensorsImage image = parse_safetensors_image(map_.data(), map_.size(), path);
  infos_ = std::move(image.header.tensors);
  metadata_ = std::move(image.header.metadata);
  // Zero-copy: views point straight into the mapping. Offsets are validated against the data
  // section, so every view lies inside the file; no alignment is promised (callers memcpy).
  const uint8_t* data = map_.data() + image.data_start;
  for (const TensorInfo& t : infos_) {
    views_.emplace(t.name, TensorView{&t, data + t.begin, &map_.path(), image.data_start + t.begin});
  }
}

const TensorView* SafetensorsFile::find(std::string_view name) const {
  const auto it = views_.find(name);
  return it == views_.end() ? nullptr : &it->second;
}

namespace {

// weight_map of a model.safetensors.index.json: tensor name -> shard file name.
std::map<std::string, std::string> read_weight_map(const std::string& index) {
  const std::string text = read_regular_file(index);
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    fail(index, std::string("bad JSON: ") + e.what());
  }
  if (!root.is_object()) fail(index, "not a JSON object");
  const auto it = root.find("weight_map");
  if (it == root.end()) fail(index, "weight_map missing");
  if (!it->is_object()) fail(index, "weight_map is not an object");
  std::map<std::string, std::string> out;
  for (const auto& [name, shard] : it->items()) {
    if (!shard.is_string()) fail(index, "weight_map entry for " + name + " is not a string");
    const std::string file = shard.get<std::string>();
    // Shards live next to the index; a path would let a crafted index open arbitrary files.
    if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos) {
      fail(index, "weight_map entry for " + name + " is not a plain file name: '" + file + "'");
    }
    out.emplace(name, file);
  }
  return out;
}

}  // namespace

Checkpoint::Checkpoint(const std::string& path) : path_(path) {
  // Registers every tensor of a file; a name already seen in another file is an error.
  auto add_file = [this](const std::string& file) -> const SafetensorsFile& {
    files_.push_back(std::make_unique<SafetensorsFile>(file));
    const SafetensorsFile& f = *files_.back();
    for (const TensorInfo& t : f.infos()) {
      const TensorView* view = f.find(t.name);
      const auto [it, inserted] = views_.emplace(t.name, view);
      if (!inserted) fail(file, "tensor " + t.name + " is also in " + *it->second->file);
    }
    return f;
  };

  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    add_file(path);  // a single file; MappedFile reports a missing path with errno text
    return;
  }
  const std::string index = (fs::path(path) / "model.safetensors.index.json").string();
  const std::string single = (fs::path(path) / "model.safetensors").string();
  if (!fs::exists(index, ec)) {
    if (!fs::exists(single, ec)) {
      fail(path, "no model.safetensors.index.json or model.safetensors in this folder");
    }
    add_file(single);
    return;
  }

  const std::map<std::string, std::string> weight_map = read_weight_map(index);
  std::map<std::string, std::vector<std::string>> by_shard;  // shard -> tensors the index puts there
  for (const auto& [name, shard] : weight_map) by_shard[shard].push_back(name);
  // The index and the shard headers must agree both ways, or a loader would pick up stale data.
  // Tensors in the wrong shard are checked for every shard first, as that says more than "missing".
  for (const auto& [shard, names] : by_shard) {
    const std::string shard_path = (fs::path(path) / shard).string();
    if (!fs::exists(shard_path, ec)) fail(index, "missing shard " + shard + " (holds " + names.front() + ")");
    for (const TensorInfo& t : add_file(shard_path).infos()) {
      const auto it = weight_map.find(t.name);
      if (it == weight_map.end()) fail(shard_path, "tensor " + t.name + " is not listed in " + index);
      if (it->second != shard) {
        fail(shard_path, "tensor " + t.name + " is in this shard but the index lists it under " + it->second);
      }
    }
  }
  for (const auto& [name, shard] : weight_map) {
    // Every tensor found is in its indexed shard (checked above), so absent here means absent there.
    if (!find(name)) {
      fail((fs::path(path) / shard).string(), "missing tensor " + name + " (listed in the index for this shard)");
    }
  }
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(views_.size());
  for (const auto& entry : views_) out.push_back(entry.first);
  return out;
}

const TensorView* Checkpoint::find(std::string_view name) const {
  const auto it = views_.find(name);
  return it == views_.end() ? nullptr : it->second;
}

const TensorView& Checkpoint::get(std::string_view name) const {
  const TensorView* view = find(name);
  if (!view) fail(path_, "missing tensor " + std::string(name));
  return *view;
}

const TensorView& Checkpoint::expect(std::string_view name, DType dtype,
                                     const std::vector<int64_t>& shape) const {
  const TensorView& view = get(name);
  const bool wrong_dtype = view.dtype() != dtype;
  const bool wrong_shape = view.shape() != shape;
  if (wrong_dtype || wrong_shape) {
    const std::string what = wrong_dtype && wrong_shape ? "wrong dtype and wrong shape"
                             : wrong_dtype              ? "wrong dtype"
                                                        : "wrong shape";
    fail(*view.file, what + ": tensor " + std::string(name) + " has shape " + shape_string(view.shape()) +
                         " dtype " + dtype_name(view.dtype()) + ", the config expects " +
                         shape_string(shape) + " " + dtype_name(dtype));
  }
  return view;
}

std::string Checkpoint::fingerprint() const {
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr) throw std::bad_alloc();
  XXH3_64bits_reset(state);
  const auto add = [state](const void* p, size_t n) { XXH3_64bits_update(state, p, n); };
  // The bytes are read with pread, not through the mapping: a fault there maps a whole fault-around
  // window of each tensor into the process, which for streamed experts the plan never counted.
  std::map<std::string, int> fds;
  struct CloseAll {
    std::map<std::string, int>& fds;
    ~CloseAll() {
      for (const auto& [path, fd] : fds) ::close(fd);
    }
  } close_all{fds};
  const auto read_at = [&](const TensorView& view, uint64_t offset, size_t n) {
    uint8_t bytes[32];
    auto it = fds.find(*view.file);
    if (it == fds.end()) {
      it = fds.emplace(*view.file, open_regular_file(*view.file)).first;
    }
    if (::pread(it->second, bytes, n, static_cast<off_t>(view.file_offset + offset)) != static_cast<ssize_t>(n)) {
      fail(*view.file, "cannot read tensor " + view.name() + ": " + errno_text(errno));
    }
    add(bytes, n);
  };
  for (const auto& [name, view] : views_) {  // std::map: name order
    add(name.data(), name.size() + 1);  // with the terminating 0, so names cannot run together
    const int32_t dtype = static_cast<int32_t>(view->dtype());
    add(&dtype, sizeof dtype);
    for (int64_t d : view->shape()) add(&d, sizeof d);
    const uint64_t bytes = view->nbytes();
    add(&bytes, sizeof bytes);
    const size_t head = std::min<size_t>(32, bytes);
    if (head > 0) read_at(*view, 0, head);
    if (bytes > head) read_at(*view, bytes - std::min<size_t>(32, bytes - head), std::min<size_t>(32, bytes - head));
  }
  const XXH64_hash_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

}  // namespace dsv41
