#include "data/features.h"

#include <cstring>

#include "io/safetensors.h"
#include "util/error.h"

namespace talon {

using json = nlohmann::json;

std::string shard_file_name(int64_t index) { return fmt::format("shard-{:05}.safetensors", index); }

json read_manifest(const fs::path& dir) {
  const fs::path p = dir / kManifestName;
  if (!fs::exists(p)) fail("{}: no {} (not a talon feature dataset)", dir.string(), kManifestName);
  json j = json::parse(read_text_file(p), nullptr, false);
  if (j.is_discarded() || !j.is_object()) fail("{}: not a valid JSON object", p.string());
  auto fmt_it = j.find("format");
  if (fmt_it == j.end() || *fmt_it != kFeaturesFormat) {
    const std::string have = fmt_it != j.end() && fmt_it->is_string() ? fmt_it->get<std::string>() : std::string();
    const std::string next =
        have == "talon.tokens"     ? " (this is `talon prepare` output: run `talon extract --data` on it to make "
                                     "features, or train with --online to make them in process)"
        : have == "talon.generate" ? " (this is `talon generate` output: run `talon prepare` on its generated.jsonl, "
                                     "then `talon extract`)"
                                   : "";
    fail("{}: field 'format' is {}, expected \"{}\"{}", p.string(), fmt_it == j.end() ? "missing" : fmt_it->dump(),
         kFeaturesFormat, next);
  }
  auto ver = j.find("format_version");
  if (ver == j.end() || !ver->is_number_integer() || ver->get<int>() != kFeaturesVersion)
    fail("{}: format_version {} not supported (this build reads version {})", p.string(),
         ver == j.end() ? "missing" : ver->dump(), kFeaturesVersion);
  return j;
}

fs::path shard_path(const fs::path& dir, const json& shard, size_t i) {
  const std::string origin = fmt::format("{}: shards[{}].file", (dir / kManifestName).string(), i);
  auto f = shard.find("file");
  if (!shard.is_object() || f == shard.end() || !f->is_string()) fail("{}: expected a file name", origin);
  return path_inside(dir, f->get<std::string>(), origin);
}

void verify_shard(const fs::path& dir, const json& shard, size_t i) {
  const fs::path p = shard_path(dir, shard, i);
  const std::string mp = (dir / kManifestName).string();
  auto sha = shard.find("sha256");
  auto bytes = shard.find("bytes");
  if (sha == shard.end() || !sha->is_string() || bytes == shard.end() || !bytes->is_number_unsigned())
    fail("{}: shards[{}]: expected fields 'sha256' (string) and 'bytes' (integer)", mp, i);
  std::error_code ec;
  const auto size = fs::file_size(p, ec);
  if (ec) fail("{}: listed in {} but cannot be read: {}", p.string(), mp, ec.message());
  if (size != bytes->get<uint64_t>())
    fail("{}: size {} bytes, {} says {} (truncated or replaced)", p.string(), size, mp, bytes->get<uint64_t>());
  const std::string got = sha256_file_hex(p);
  if (got != sha->get<std::string>())
    fail("{}: SHA-256 {} does not match the manifest's {} (the shard is corrupt)", p.string(), got,
         sha->get<std::string>());
}

DatasetCheck check_dataset(const fs::path& dir, bool checksums) {
  DatasetCheck r;
  json m = read_manifest(dir);
  const std::string mp = (dir / kManifestName).string();
  auto problem = [&](std::string s) {
    r.ok = false;
    r.problems.push_back(std::move(s));
  };
  try {
    const int64_t H = m.at("hidden_size").get<int64_t>();
    const std::string dtype = m.at("dtype").get<std::string>();
    const DType dt = dtype == "bf16" ? DType::BF16 : DType::F32;
    const int64_t n_aux = int64_t(m.at("aux_layer_ids").size());
    int64_t expect_index = 0;
    size_t si = 0;
    for (auto& s : m.at("shards")) {
      const fs::path p = shard_path(dir, s, si++);
      ++r.shards;
      if (!fs::exists(p)) {
        problem(fmt::format("{}: listed in the manifest but missing", p.string()));
        continue;
      }
      const int64_t bytes = s.at("bytes").get<int64_t>();
      if (int64_t(fs::file_size(p)) != bytes) {
        problem(fmt::format("{}: size {} bytes, manifest says {}", p.string(), fs::file_size(p), bytes));
        continue;
      }
      r.bytes += bytes;
      if (checksums) {
        const std::string sha = sha256_file_hex(p);
        if (sha != s.at("sha256").get<std::string>()) {
          problem(fmt::format("{}: SHA-256 {} does not match the manifest's {}", p.string(), sha,
                              s.at("sha256").get<std::string>()));
          continue;
        }
      }
      st::File sf(p);
      const int64_t n = s.at("samples").get<int64_t>(), T = s.at("tokens").get<int64_t>();
      sf.get(shard_tensors::input_ids, DType::I32, {T});
      const auto& mask = sf.get(shard_tensors::loss_mask, DType::U8, {T});
      sf.get(shard_tensors::aux_hidden, dt, {T, n_aux * H});
      sf.get(shard_tensors::hidden, dt, {T, H});
      const auto& off = sf.get(shard_tensors::sample_offsets, DType::I64, {n + 1});
      const auto& idx = sf.get(shard_tensors::sample_index, DType::I64, {n});
      std::vector<int64_t> o(static_cast<size_t>(n + 1)), ix(static_cast<size_t>(n));
      std::memcpy(o.data(), off.data, off.nbytes);
      std::memcpy(ix.data(), idx.data, idx.nbytes);
      if (o.front() != 0 || o.back() != T) problem(fmt::format("{}: sample_offsets must run from 0 to {}", p.string(), T));
      for (int64_t i = 0; i < n; ++i) {
        if (o[size_t(i + 1)] <= o[size_t(i)]) problem(fmt::format("{}: sample_offsets not increasing at {}", p.string(), i));
        if (ix[size_t(i)] != expect_index)
          problem(fmt::format("{}: sample_index[{}] = {}, expected {} (samples lost or duplicated)", p.string(), i,
                              ix[size_t(i)], expect_index));
        ++expect_index;
      }
      for (size_t i = 0; i < mask.nbytes; ++i) r.loss_tokens += mask.data[i];
      r.samples += n;
      r.tokens += T;
    }
    if (m.at("status") == "complete") {
      if (r.samples != m.at("num_samples").get<int64_t>())
        problem(fmt::format("{}: shards hold {} samples, manifest says {}", mp, r.samples, m.at("num_samples").dump()));
      if (r.tokens != m.at("num_tokens").get<int64_t>())
        problem(fmt::format("{}: shards hold {} tokens, manifest says {}", mp, r.tokens, m.at("num_tokens").dump()));
    }
  } catch (const json::exception& e) {
    problem(fmt::format("{}: malformed manifest: {}", mp, e.what()));
  } catch (const Error& e) {
    problem(e.what());
  }
  return r;
}

}  // namespace talon
