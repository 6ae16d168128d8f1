#include "draft/family.h"

#include <deque>

#include "draft/dflash.h"
#include "draft/peagle.h"
#include "draft/trainer.h"
#include "util/error.h"

namespace talon::train {

using json = nlohmann::json;

namespace {

// N(0, 0.02) matrices from the trainer's seeded source.
void fill(std::vector<float>& v, int64_t n, const std::function<double()>& normal) {
  v.resize(size_t(n));
  for (auto& x : v) x = float(0.02 * normal());
}
// Rows of the target's lm_head for the draft vocabulary (the frozen lm_head both families keep).
std::vector<float> kept_rows(const std::vector<float>& head, const eagle3::DraftVocab& dv, int64_t H) {
  std::vector<float> out(dv.kept.size() * size_t(H));
  for (size_t d = 0; d < dv.kept.size(); ++d)
    std::copy(head.begin() + dv.kept[d] * H, head.begin() + (dv.kept[d] + 1) * H, out.begin() + int64_t(d) * H);
  return out;
}
std::vector<uint8_t> valid_rows(const eagle3::Sample& s) {
  std::vector<uint8_t> v(static_cast<size_t>(s.T - 1));
  for (int64_t t = 0; t + 1 < s.T; ++t) v[size_t(t)] = s.mask[t + 1];
  return v;
}

// ---- P-EAGLE -------------------------------------------------------------------------------

// The optimizer's view of P-EAGLE: the layer's weights without the frozen lm_head, then
// mask_hidden and the (trained) embeddings.
std::vector<Param> peagle_params(peagle::Weights& w, peagle::Grads& g) {
  std::vector<Param> ps = draft_params(w.layer, g.layer);
  std::erase_if(ps, [](const Param& p) { return std::string(p.name) == "lm_head"; });
  ps.push_back({"mask_hidden", &w.mask_hidden, &g.mask_hidden, false});
  ps.push_back({"embed", &w.embed, &g.embed, true});
  return ps;
}

class PEagleFamily final : public Family {
 public:
  explicit PEagleFamily(const FamilyInit& in) : c_(in.c), tgt_(in.tgt), dv_(in.dv), mask_token_(in.mask_token) {
    const TrainOptions& o = in.opt;
    TALON_CHECK(o.cod_ratio > 0 && o.cod_ratio < 1 && o.cod_ratio_min >= 0 && o.cod_ratio_min <= 1,
                "--cod-ratio {} / --cod-ratio-min {}: expected a ratio in (0, 1) and a floor in [0, 1]", o.cod_ratio,
                o.cod_ratio_min);
    cod_ = {c_.ttt_steps, o.cod_ratio, o.cod_ratio_min};
    // The EAGLE-3 layer as the trainer starts it (same draws, same order), then as speculators
    // starts P-EAGLE: the target's embeddings (then trained) and its lm_head rows of the draft
    // vocabulary (kept frozen); mask_hidden ~ N(0, 1).
    const int64_t H = c_.H, qd = c_.n_heads * c_.head_dim, kvd = c_.n_kv_heads * c_.head_dim;
    auto& L = w_.layer;
    fill(L.fc, H * 3 * H, in.normal);
    fill(L.wq, qd * 2 * H, in.normal);
    fill(L.wk, kvd * 2 * H, in.normal);
    fill(L.wv, kvd * 2 * H, in.normal);
    fill(L.wo, H * qd, in.normal);
    fill(L.gate, c_.I * H, in.normal);
    fill(L.up, c_.I * H, in.normal);
    fill(L.down, H * c_.I, in.normal);
    fill(L.lm_head, c_.Vd * H, in.normal);  // (drawn as EAGLE-3 draws it, then replaced)
    for (auto* v : {&L.in_ln, &L.hidden_norm, &L.post_ln, &L.norm}) v->assign(size_t(H), 1.0f);
    L.lm_head = kept_rows(in.head, dv_, H);
    w_.embed = in.embed;
    w_.mask_hidden.resize(size_t(3 * H));
    for (auto& x : w_.mask_hidden) x = float(in.normal());
    g_ = std::make_unique<peagle::Grads>(w_);
  }
  const char* name() const override { return "peagle"; }
  std::vector<Param> params() override { return peagle_params(w_, *g_); }
  std::vector<std::pair<std::string, const std::vector<float>*>> frozen() override {
    return {{"lm_head", &w_.layer.lm_head}};
  }
  int width() const override { return c_.ttt_steps; }
  eagle3::TttResult run(const eagle3::Sample& s, uint64_t seed, bool backward) override {
    const std::vector<uint8_t> valid = valid_rows(s);
    const peagle::CodSample cod = backward ? peagle::cod_sample(valid, cod_, seed) : peagle::all_chains(valid, c_.ttt_steps);
    const peagle::Result r = peagle::forward(c_, w_, tgt_, dv_, s, cod, mask_token_, backward ? g_.get() : nullptr);
    return peagle::ttt_view(cod, r, c_.ttt_steps);
  }
  json job() const override {
    return {{"drafter", "peagle"}, {"mask_token_id", mask_token_}, {"cod_ratio", cod_.ratio},
            {"cod_ratio_min", cod_.ratio_min}};
  }
  json draft() const override { return json::object(); }
  // The embedding rows a sample's elements read (peagle.cpp): its tokens after the first (the
  // next token of each depth-0 anchor) and the mask token of every deeper element.
  const char* row_sparse_param() const override { return "embed"; }
  void touched_rows(const eagle3::Sample& s, std::vector<int64_t>& rows) const override {
    for (int64_t t = 1; t < s.T; ++t) rows.push_back(s.ids[t]);
    rows.push_back(mask_token_);
  }
  std::string describe() const override {
    return fmt::format("P-EAGLE: {} depths, mask token {}, COD keeps max({}^d, {}) of the chains at depth d; "
                       "embeddings trained, lm_head frozen",
                       c_.ttt_steps, mask_token_, cod_.ratio, cod_.ratio_min);
  }

 private:
  const eagle3::DraftConfig& c_;
  const eagle3::TargetHead& tgt_;
  const eagle3::DraftVocab& dv_;
  int32_t mask_token_;
  peagle::CodOptions cod_;
  peagle::Weights w_;
  std::unique_ptr<peagle::Grads> g_;
};

// ---- DFlash --------------------------------------------------------------------------------

class DFlashFamily final : public Family {
 public:
  explicit DFlashFamily(const FamilyInit& in) : tgt_(in.tgt), dv_(in.dv), mask_token_(in.mask_token) {
    const TrainOptions& o = in.opt;
    c_ = dflash_config(in.c, o);
    max_anchors_ = o.max_anchors;
    TALON_CHECK(max_anchors_ >= 1, "--max-anchors {}: expected >= 1", max_anchors_);
    // Fresh weights as speculators' post_init makes them (N(0, 0.02) matrices, unit norms);
    // the lm_head is the target's rows of the draft vocabulary, frozen like the embedding.
    const int64_t H = c_.H, qd = c_.n_heads * c_.head_dim, kvd = c_.n_kv_heads * c_.head_dim;
    fill(w_.fc, H * c_.n_aux * H, in.normal);
    w_.hidden_norm.assign(size_t(H), 1.0f);
    w_.layers.resize(size_t(c_.layers));
    for (auto& L : w_.layers) {
      fill(L.wq, qd * H, in.normal);
      fill(L.wk, kvd * H, in.normal);
      fill(L.wv, kvd * H, in.normal);
      fill(L.wo, H * qd, in.normal);
      fill(L.gate, c_.I * H, in.normal);
      fill(L.up, c_.I * H, in.normal);
      fill(L.down, H * c_.I, in.normal);
      for (auto* v : {&L.in_ln, &L.post_ln}) v->assign(size_t(H), 1.0f);
      for (auto* v : {&L.q_norm, &L.k_norm}) v->assign(size_t(c_.head_dim), 1.0f);
    }
    w_.norm.assign(size_t(H), 1.0f);
    w_.lm_head = kept_rows(in.head, dv_, H);
    g_ = std::make_unique<dflash::Grads>(w_);
  }
  const char* name() const override { return "dflash"; }
  std::vector<Param> params() override {
    names_.clear();
    std::vector<Param> ps;
    auto add = [&](const std::string& n, std::vector<float>* w, std::vector<double>* g, bool decay) {
      names_.push_back(n);
      ps.push_back({names_.back().c_str(), w, g, decay});
    };
    add("fc", &w_.fc, &g_->fc, true);
    add("hidden_norm", &w_.hidden_norm, &g_->hidden_norm, false);
    for (int64_t l = 0; l < c_.layers; ++l) {
      auto wn = w_.layers[size_t(l)].named();
      auto gn = g_->layers[size_t(l)].named();
      for (size_t i = 0; i < wn.size(); ++i) {
        const std::string n = wn[i].first;
        add(fmt::format("layers.{}.{}", l, n), wn[i].second, gn[i].second, n.find("norm") == std::string::npos &&
                                                                              n.find("_ln") == std::string::npos);
      }
    }
    add("norm", &w_.norm, &g_->norm, false);
    return ps;
  }
  std::vector<std::pair<std::string, const std::vector<float>*>> frozen() override {
    return {{"lm_head", &w_.lm_head}};
  }
  int width() const override { return int(c_.block - 1); }
  eagle3::TttResult run(const eagle3::Sample& s, uint64_t seed, bool backward) override {
    // Training draws up to --max-anchors anchors; the evaluation takes every candidate.
    const std::vector<int64_t> anchors =
        dflash::select_anchors(s.mask, s.T, c_.block, backward ? max_anchors_ : s.T, backward ? seed : 0);
    if (anchors.empty()) return dflash::ttt_view(dflash::Result{}, c_.block);  // nothing to predict
    return dflash::ttt_view(
        dflash::forward(c_, w_, tgt_, dv_, s, anchors, mask_token_, backward ? g_.get() : nullptr), c_.block);
  }
  json job() const override {
    return {{"drafter", "dflash"}, {"mask_token_id", mask_token_}, {"draft_layers", c_.layers},
            {"block_size", c_.block}, {"dflash_loss", c_.loss == dflash::Config::Loss::CE ? "ce" : "kl"},
            {"dflash_weighting", c_.weighting == dflash::Config::Weighting::DPace ? "dpace" : "fixed-exp-decay"},
            {"dflash_gamma", c_.gamma}, {"dpace_alpha", c_.dpace_alpha}, {"max_anchors", max_anchors_}};
  }
  json draft() const override {
    return {{"num_hidden_layers", c_.layers}, {"block_size", c_.block}, {"num_aux_layers", c_.n_aux}};
  }
  std::string describe() const override {
    return fmt::format("DFlash: {} layers, blocks of {}, mask token {}, {} with {} weights, up to {} anchors a sample; "
                       "embedding and lm_head frozen",
                       c_.layers, c_.block, mask_token_, c_.loss == dflash::Config::Loss::CE ? "cross-entropy" : "KL",
                       c_.weighting == dflash::Config::Weighting::DPace ? "D-PACE" : "fixed-exp-decay", max_anchors_);
  }

 private:
  const eagle3::TargetHead& tgt_;
  const eagle3::DraftVocab& dv_;
  int32_t mask_token_;
  dflash::Config c_;
  int64_t max_anchors_ = 512;
  dflash::Weights w_;
  std::unique_ptr<dflash::Grads> g_;
  std::deque<std::string> names_;  // Param names point into it
};

}  // namespace

dflash::Config dflash_config(const eagle3::DraftConfig& c, const TrainOptions& o) {
  dflash::Config d;
  d.H = c.H, d.I = c.I, d.n_heads = c.n_heads, d.n_kv_heads = c.n_kv_heads, d.head_dim = c.head_dim;
  d.V = c.V, d.Vd = c.Vd, d.rms_eps = c.rms_eps, d.rope = c.rope;
  d.layers = o.draft_layers;
  d.block = o.block_size;
  d.n_aux = 3;  // extract's aux layers
  TALON_CHECK(o.dflash_loss == "kl" || o.dflash_loss == "ce", "--dflash-loss '{}': expected kl or ce", o.dflash_loss);
  TALON_CHECK(o.dflash_weighting == "dpace" || o.dflash_weighting == "fixed-exp-decay",
              "--dflash-weighting '{}': expected dpace or fixed-exp-decay", o.dflash_weighting);
  d.loss = o.dflash_loss == "ce" ? dflash::Config::Loss::CE : dflash::Config::Loss::KL;
  d.weighting = o.dflash_weighting == "dpace" ? dflash::Config::Weighting::DPace : dflash::Config::Weighting::ExpDecay;
  d.gamma = o.dflash_gamma;
  d.dpace_alpha = o.dpace_alpha;
  TALON_CHECK(d.layers >= 1 && d.block >= 2, "--draft-layers {} / --block-size {}: expected >= 1 and >= 2", d.layers,
              d.block);
  TALON_CHECK(d.gamma > 0 && d.dpace_alpha >= 0 && d.dpace_alpha <= 1,
              "--dflash-gamma {} / --dpace-alpha {}: expected > 0 and in [0, 1]", d.gamma, d.dpace_alpha);
  return d;
}

std::unique_ptr<Family> make_family(const std::string& drafter, const FamilyInit& init) {
  if (drafter == "peagle") return std::make_unique<PEagleFamily>(init);
  if (drafter == "dflash") return std::make_unique<DFlashFamily>(init);
  fail("--drafter '{}': expected eagle3, peagle or dflash", drafter);
}

}  // namespace talon::train
