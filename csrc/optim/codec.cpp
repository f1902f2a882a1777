#include "optim/codec.h"

#include <shardopt/check.h>
#include <shardopt/optim/muon.h>

#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <c10/util/Type.h>
#include <torch/csrc/api/include/torch/optim/adagrad.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/rmsprop.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>

#include <ATen/ops/zeros.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>
#include <typeindex>
#include <typeinfo>

namespace shardopt::detail {

namespace optim = torch::optim;

GenericDict make_string_dict() {
  return GenericDict(c10::StringType::get(), c10::AnyType::get());
}

namespace {

double get_double(const GenericDict& d, const char* key, double fallback) {
  if (!d.contains(key)) return fallback;
  const auto& v = d.at(key);
  SHARDOPT_CHECK(v.isDouble() || v.isInt(), "state_dict option '", key, "' must be a number, got ", v.tagKind());
  return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
}

bool get_bool(const GenericDict& d, const char* key, bool fallback) {
  if (!d.contains(key)) return fallback;
  const auto& v = d.at(key);
  SHARDOPT_CHECK(v.isBool(), "state_dict option '", key, "' must be a bool, got ", v.tagKind());
  return v.toBool();
}

std::tuple<double, double> get_betas(const GenericDict& d, std::tuple<double, double> fallback) {
  if (!d.contains("betas")) return fallback;
  const auto& v = d.at("betas");
  std::vector<c10::IValue> items;
  if (v.isTuple()) {
    items = v.toTupleRef().elements().vec();
  } else if (v.isList()) {
    items = v.toListRef().vec();
  }
  SHARDOPT_CHECK(items.size() == 2, "state_dict option 'betas' must hold two numbers");
  auto num = [](const c10::IValue& x) { return x.isDouble() ? x.toDouble() : static_cast<double>(x.toInt()); };
  return {num(items[0]), num(items[1])};
}

at::Tensor get_tensor(const GenericDict& d, const char* key) {
  if (!d.contains(key)) return at::Tensor();
  const auto& v = d.at(key);
  if (v.isNone()) return at::Tensor();
  SHARDOPT_CHECK(v.isTensor(), "state entry '", key, "' must be a tensor, got ", v.tagKind());
  return v.toTensor().clone();
}

// PyTorch keeps "step" as a float32 scalar tensor; older files and LibTorch use an integer.
int64_t get_step(const GenericDict& d) {
  if (!d.contains("step")) return 0;
  const auto& v = d.at("step");
  if (v.isTensor()) return static_cast<int64_t>(v.toTensor().item<double>());
  if (v.isDouble()) return static_cast<int64_t>(v.toDouble());
  SHARDOPT_CHECK(v.isInt(), "state entry 'step' must be a number or a tensor, got ", v.tagKind());
  return v.toInt();
}

c10::IValue step_value(int64_t step) {
  return at::scalar_tensor(static_cast<double>(step), at::kFloat);
}

void put_tensor(GenericDict& d, const char* key, const at::Tensor& t) {
  if (t.defined()) d.insert(key, t);
}

// Replaces state tensor `name` of `s` (when defined) by what `place` gives for it.
#define SHARDOPT_PLACE(s, name) \
  if ((s).name().defined()) (s).name(place(#name, (s).name()))

// Keys PyTorch's optimizers carry that have no LibTorch counterpart, at their default values,
// so that torch.optim's load_state_dict sees a complete group.
void put_python_defaults(GenericDict& d, bool has_capturable, bool has_fused) {
  d.insert("maximize", false);
  d.insert("foreach", c10::IValue());
  d.insert("differentiable", false);
  if (has_capturable) d.insert("capturable", false);
  if (has_fused) d.insert("fused", c10::IValue());
}

// ---- Adam and AdamW share everything but the class and decoupled_weight_decay ------------

template <class Options, class State, bool kDecoupled>
struct AdamLike {
  static GenericDict encode_options(const optim::OptimizerOptions& base) {
    const auto& o = static_cast<const Options&>(base);
    auto d = make_string_dict();
    d.insert("lr", o.lr());
    d.insert("betas", c10::ivalue::Tuple::create({std::get<0>(o.betas()), std::get<1>(o.betas())}));
    d.insert("eps", o.eps());
    d.insert("weight_decay", o.weight_decay());
    d.insert("amsgrad", o.amsgrad());
    d.insert("decoupled_weight_decay", kDecoupled);
    put_python_defaults(d, true, true);
    return d;
  }
  static std::unique_ptr<optim::OptimizerOptions> decode_options(const GenericDict& d,
                                                                 const optim::OptimizerOptions& base) {
    auto o = std::make_unique<Options>(static_cast<const Options&>(base));
    o->lr(get_double(d, "lr", o->lr()));
    o->betas(get_betas(d, o->betas()));
    o->eps(get_double(d, "eps", o->eps()));
    o->weight_decay(get_double(d, "weight_decay", o->weight_decay()));
    o->amsgrad(get_bool(d, "amsgrad", o->amsgrad()));
    SHARDOPT_CHECK(get_bool(d, "decoupled_weight_decay", kDecoupled) == kDecoupled,
                "the state_dict was saved with decoupled_weight_decay=", !kDecoupled,
                ", which this optimizer does not implement");
    return o;
  }
  static GenericDict encode_state(const optim::OptimizerParamState& base) {
    const auto& s = static_cast<const State&>(base);
    auto d = make_string_dict();
    d.insert("step", step_value(s.step()));
    put_tensor(d, "exp_avg", s.exp_avg());
    put_tensor(d, "exp_avg_sq", s.exp_avg_sq());
    put_tensor(d, "max_exp_avg_sq", s.max_exp_avg_sq());
    return d;
  }
  static std::unique_ptr<optim::OptimizerParamState> decode_state(const GenericDict& d) {
    auto s = std::make_unique<State>();
    s->step(get_step(d));
    s->exp_avg(get_tensor(d, "exp_avg"));
    s->exp_avg_sq(get_tensor(d, "exp_avg_sq"));
    s->max_exp_avg_sq(get_tensor(d, "max_exp_avg_sq"));
    return s;
  }
  static int64_t state_numel(const optim::OptimizerOptions& base, at::IntArrayRef sizes) {
    return (2 + (static_cast<const Options&>(base).amsgrad() ? 1 : 0)) * c10::multiply_integers(sizes);
  }
  static void place_state(optim::OptimizerParamState& base, const StatePlacer& place) {
    auto& s = static_cast<State&>(base);
    SHARDOPT_PLACE(s, exp_avg);
    SHARDOPT_PLACE(s, exp_avg_sq);
    SHARDOPT_PLACE(s, max_exp_avg_sq);
  }
};

struct SGDCodec {
  static GenericDict encode_options(const optim::OptimizerOptions& base) {
    const auto& o = static_cast<const optim::SGDOptions&>(base);
    auto d = make_string_dict();
    d.insert("lr", o.lr());
    d.insert("momentum", o.momentum());
    d.insert("dampening", o.dampening());
    d.insert("weight_decay", o.weight_decay());
    d.insert("nesterov", o.nesterov());
    put_python_defaults(d, false, true);
    return d;
  }
  static std::unique_ptr<optim::OptimizerOptions> decode_options(const GenericDict& d,
                                                                 const optim::OptimizerOptions& base) {
    auto o = std::make_unique<optim::SGDOptions>(static_cast<const optim::SGDOptions&>(base));
    o->lr(get_double(d, "lr", o->lr()));
    o->momentum(get_double(d, "momentum", o->momentum()));
    o->dampening(get_double(d, "dampening", o->dampening()));
    o->weight_decay(get_double(d, "weight_decay", o->weight_decay()));
    o->nesterov(get_bool(d, "nesterov", o->nesterov()));
    return o;
  }
  static GenericDict encode_state(const optim::OptimizerParamState& base) {
    const auto& s = static_cast<const optim::SGDParamState&>(base);
    auto d = make_string_dict();
    put_tensor(d, "momentum_buffer", s.momentum_buffer());
    return d;
  }
  static std::unique_ptr<optim::OptimizerParamState> decode_state(const GenericDict& d) {
    auto s = std::make_unique<optim::SGDParamState>();
    s->momentum_buffer(get_tensor(d, "momentum_buffer"));
    return s;
  }
  static int64_t state_numel(const optim::OptimizerOptions& base, at::IntArrayRef sizes) {
    return static_cast<const optim::SGDOptions&>(base).momentum() != 0 ? c10::multiply_integers(sizes) : 0;
  }
  static void place_state(optim::OptimizerParamState& base, const StatePlacer& place) {
    auto& s = static_cast<optim::SGDParamState&>(base);
    SHARDOPT_PLACE(s, momentum_buffer);
  }
};

struct RMSpropCodec {
  static GenericDict encode_options(const optim::OptimizerOptions& base) {
    const auto& o = static_cast<const optim::RMSpropOptions&>(base);
    auto d = make_string_dict();
    d.insert("lr", o.lr());
    d.insert("alpha", o.alpha());
    d.insert("eps", o.eps());
    d.insert("weight_decay", o.weight_decay());
    d.insert("momentum", o.momentum());
    d.insert("centered", o.centered());
    put_python_defaults(d, true, false);
    return d;
  }
  static std::unique_ptr<optim::OptimizerOptions> decode_options(const GenericDict& d,
                                                                 const optim::OptimizerOptions& base) {
    auto o = std::make_unique<optim::RMSpropOptions>(static_cast<const optim::RMSpropOptions&>(base));
    o->lr(get_double(d, "lr", o->lr()));
    o->alpha(get_double(d, "alpha", o->alpha()));
    o->eps(get_double(d, "eps", o->eps()));
    o->weight_decay(get_double(d, "weight_decay", o->weight_decay()));
    o->momentum(get_double(d, "momentum", o->momentum()));
    o->centered(get_bool(d, "centered", o->centered()));
    return o;
  }
  static GenericDict encode_state(const optim::OptimizerParamState& base) {
    const auto& s = static_cast<const optim::RMSpropParamState&>(base);
    auto d = make_string_dict();
    d.insert("step", step_value(s.step()));
    put_tensor(d, "square_avg", s.square_avg());
    put_tensor(d, "momentum_buffer", s.momentum_buffer());
    put_tensor(d, "grad_avg", s.grad_avg());
    return d;
  }
  static std::unique_ptr<optim::OptimizerParamState> decode_state(const GenericDict& d) {
    auto s = std::make_unique<optim::RMSpropParamState>();
    s->step(get_step(d));
    s->square_avg(get_tensor(d, "square_avg"));
    s->momentum_buffer(get_tensor(d, "momentum_buffer"));
    s->grad_avg(get_tensor(d, "grad_avg"));
    return s;
  }
  static int64_t state_numel(const optim::OptimizerOptions& base, at::IntArrayRef sizes) {
    const auto& o = static_cast<const optim::RMSpropOptions&>(base);
    return (1 + (o.momentum() > 0 ? 1 : 0) + (o.centered() ? 1 : 0)) * c10::multiply_integers(sizes);
  }
  static void place_state(optim::OptimizerParamState& base, const StatePlacer& place) {
    auto& s = static_cast<optim::RMSpropParamState&>(base);
    SHARDOPT_PLACE(s, square_avg);
    SHARDOPT_PLACE(s, momentum_buffer);
    SHARDOPT_PLACE(s, grad_avg);
  }
};

struct AdagradCodec {
  static GenericDict encode_options(const optim::OptimizerOptions& base) {
    const auto& o = static_cast<const optim::AdagradOptions&>(base);
    auto d = make_string_dict();
    d.insert("lr", o.lr());
    d.insert("lr_decay", o.lr_decay());
    d.insert("weight_decay", o.weight_decay());
    d.insert("initial_accumulator_value", o.initial_accumulator_value());
    d.insert("eps", o.eps());
    put_python_defaults(d, false, true);
    return d;
  }
  static std::unique_ptr<optim::OptimizerOptions> decode_options(const GenericDict& d,
                                                                 const optim::OptimizerOptions& base) {
    auto o = std::make_unique<optim::AdagradOptions>(static_cast<const optim::AdagradOptions&>(base));
    o->lr(get_double(d, "lr", o->lr()));
    o->lr_decay(get_double(d, "lr_decay", o->lr_decay()));
    o->weight_decay(get_double(d, "weight_decay", o->weight_decay()));
    o->initial_accumulator_value(get_double(d, "initial_accumulator_value", o->initial_accumulator_value()));
    o->eps(get_double(d, "eps", o->eps()));
    return o;
  }
  static GenericDict encode_state(const optim::OptimizerParamState& base) {
    const auto& s = static_cast<const optim::AdagradParamState&>(base);
    auto d = make_string_dict();
    d.insert("step", step_value(s.step()));
    put_tensor(d, "sum", s.sum());
    return d;
  }
  static std::unique_ptr<optim::OptimizerParamState> decode_state(const GenericDict& d) {
    auto s = std::make_unique<optim::AdagradParamState>();
    s->step(get_step(d));
    s->sum(get_tensor(d, "sum"));
    return s;
  }
  static int64_t state_numel(const optim::OptimizerOptions&, at::IntArrayRef sizes) {
    return c10::multiply_integers(sizes);
  }
  static void place_state(optim::OptimizerParamState& base, const StatePlacer& place) {
    auto& s = static_cast<optim::AdagradParamState&>(base);
    SHARDOPT_PLACE(s, sum);
  }
};

#undef SHARDOPT_PLACE

double numel_cost(at::IntArrayRef sizes) {
  return static_cast<double>(c10::multiply_integers(sizes));
}

std::vector<int64_t> like_param(const std::string&, at::IntArrayRef sizes) {
  return sizes.vec();
}

template <class C>
OptimizerCodec make_codec(const char* name) {
  OptimizerCodec codec;
  codec.name = name;
  codec.encode_options = &C::encode_options;
  codec.decode_options = &C::decode_options;
  codec.encode_state = &C::encode_state;
  codec.decode_state = &C::decode_state;
  codec.place_state = &C::place_state;
  codec.state_numel = &C::state_numel;
  codec.cost = &numel_cost;
  codec.entry_shape = &like_param;
  return codec;
}

// A codec that reads and writes what a registration names (shardopt/optim/state_layout.h).
OptimizerCodec codec_of(OptimizerLayout layout) {
  auto l = std::make_shared<const OptimizerLayout>(std::move(layout));
  OptimizerCodec codec;
  codec.name = l->name;
  codec.kind = l->kind;
  codec.encode_options = [l](const optim::OptimizerOptions& o) {
    auto d = make_string_dict();
    for (const auto& option : l->options) d.insert(option.name, option.get(o));
    for (const auto& [name, value] : l->constants) d.insert(name, value);
    return d;
  };
  codec.decode_options = [l](const GenericDict& d, const optim::OptimizerOptions& base) {
    auto o = base.clone();
    for (const auto& option : l->options) {
      if (d.contains(option.name)) option.set(*o, d.at(option.name));
    }
    return o;
  };
  codec.encode_state = [l](const optim::OptimizerParamState& base) {
    auto& s = const_cast<optim::OptimizerParamState&>(base);
    auto d = make_string_dict();
    if (l->step) d.insert("step", step_value(l->step(s)));
    for (const auto& entry : l->tensors) put_tensor(d, entry.name.c_str(), entry.field(s));
    return d;
  };
  codec.decode_state = [l](const GenericDict& d) {
    auto s = l->make_state();
    if (l->step) l->step(*s) = get_step(d);
    for (const auto& entry : l->tensors) entry.field(*s) = get_tensor(d, entry.name.c_str());
    return s;
  };
  codec.place_state = [l](optim::OptimizerParamState& s, const StatePlacer& place) {
    for (const auto& entry : l->tensors) {
      at::Tensor& t = entry.field(s);
      if (t.defined()) t = place(entry.name.c_str(), t);
    }
  };
  codec.state_numel = [l](const optim::OptimizerOptions&, at::IntArrayRef sizes) {
    int64_t numel = 0;
    for (const auto& entry : l->tensors) {
      numel += entry.shape ? c10::multiply_integers(entry.shape(sizes)) : c10::multiply_integers(sizes);
    }
    return numel;
  };
  codec.cost = l->cost ? l->cost : std::function<double(at::IntArrayRef)>(&numel_cost);
  for (const auto& entry : l->tensors) {
    if (entry.codes != StateCodes::kNone) codec.compressible.push_back(entry.name);
  }
  codec.entry_shape = [l](const std::string& name, at::IntArrayRef sizes) {
    for (const auto& entry : l->tensors) {
      if (entry.name == name && entry.shape) return entry.shape(sizes);
    }
    return sizes.vec();
  };
  return codec;
}

// The classes shardopt knows, and the registered ones.
struct Registry {
  std::mutex mutex;
  std::map<std::type_index, OptimizerCodec> codecs;
  // 8-bit state entries by name: whether each takes the signed map (signed_state()).
  std::map<std::string, bool> signed_codes{
      {"exp_avg", true}, {"exp_avg_sq", false}, {"max_exp_avg_sq", false}, {"momentum_buffer", true}};
};

Registry& registry() {
  static Registry r;
  return r;
}

bool built_in(const std::type_index& type) {
  return type == typeid(optim::Adam) || type == typeid(optim::AdamW) || type == typeid(optim::SGD) ||
         type == typeid(optim::RMSprop) || type == typeid(optim::Adagrad);
}

}  // namespace

void register_layout(std::type_index type, const std::string& type_name, OptimizerLayout layout) {
  const std::string cls = c10::demangle(type_name.c_str());
  SHARDOPT_CHECK(!built_in(type), "register_optimizer: shardopt already knows how ", cls,
                 "'s state is laid out; it cannot be registered again");
  SHARDOPT_CHECK(!layout.name.empty(), "register_optimizer for ", cls, ": the name is empty");
  std::vector<std::string> names{"step"};
  for (const auto& entry : layout.tensors) {
    SHARDOPT_CHECK(entry.field, "register_optimizer for ", cls, ": state entry '", entry.name, "' has no field");
    SHARDOPT_CHECK(std::find(names.begin(), names.end(), entry.name) == names.end(), "register_optimizer for ",
                   cls, ": state entry '", entry.name, "' is named twice (or is 'step', which step() registers)");
    SHARDOPT_CHECK(!entry.shape || layout.kind == StateKind::kWholeTensor, "register_optimizer for ", cls,
                   ": state entry '", entry.name, "' has a shape of its own, which only a kWholeTensor "
                   "optimizer may have (an element-wise optimizer's state is cut like its parameter)");
    names.push_back(entry.name);
  }
  for (const auto& option : layout.options) {
    SHARDOPT_CHECK(option.get && option.set, "register_optimizer for ", cls, ": option '", option.name,
                   "' has no field");
  }
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& entry : layout.tensors) {
    if (entry.codes == StateCodes::kNone) continue;
    const bool is_signed = entry.codes == StateCodes::kSigned;
    auto [it, fresh] = r.signed_codes.emplace(entry.name, is_signed);
    SHARDOPT_CHECK(fresh || it->second == is_signed, "register_optimizer for ", cls, ": state entry '", entry.name,
                   "' is compressible with the ", is_signed ? "signed" : "unsigned", " map, but 8-bit '", entry.name,
                   "' takes the ", it->second ? "signed" : "unsigned", " one (an entry name has one map)");
  }
  r.codecs.insert_or_assign(type, codec_of(std::move(layout)));
}

bool signed_state(const std::string& entry) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.signed_codes.find(entry);
  return it == r.signed_codes.end() || it->second;
}

namespace {

// The codecs of the built-in classes, in built_in()'s order.
const std::array<OptimizerCodec, 5>& built_in_codecs() {
  using AdamCodec = AdamLike<optim::AdamOptions, optim::AdamParamState, false>;
  using AdamWCodec = AdamLike<optim::AdamWOptions, optim::AdamWParamState, true>;
  static const std::array<OptimizerCodec, 5> codecs = [] {
    std::array<OptimizerCodec, 5> c = {make_codec<AdamCodec>("Adam"), make_codec<AdamWCodec>("AdamW"),
                                       make_codec<SGDCodec>("SGD"), make_codec<RMSpropCodec>("RMSprop"),
                                       make_codec<AdagradCodec>("Adagrad")};
    // What the fused step keeps in 8-bit codes (Note [8-bit state slabs]).
    c[0].compressible = c[1].compressible = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    c[2].compressible = {"momentum_buffer"};
    return c;
  }();
  return codecs;
}

// Muon is registered through the public call, the first time any optimizer is looked up.
void register_muon_once() {
  static std::once_flag muon;
  std::call_once(muon, [] { register_muon(); });
}

// Whether `codec` keeps each state entry of `values` (per-element tensors): decoded and encoded
// again, an entry it does not keep is gone. Probed on one-element tensors.
std::vector<std::string> not_kept(const OptimizerCodec& codec, const GenericDict& values) {
  GenericDict probe = make_string_dict();
  std::vector<std::string> tensors;
  for (const auto& v : values) {
    if (!is_state_tensor(v)) continue;
    tensors.push_back(v.key().toStringRef());
    probe.insert(v.key(), at::zeros({1}));
  }
  if (tensors.empty()) return {};
  if (values.contains("step")) probe.insert("step", values.at("step"));
  const GenericDict kept = codec.encode_state(*codec.decode_state(probe));
  std::vector<std::string> out;
  for (const auto& name : tensors) {
    if (!kept.contains(name)) out.push_back(name);
  }
  return out;
}

}  // namespace

std::vector<std::string> entries_not_kept(const OptimizerCodec& codec, const GenericDict& values) {
  return not_kept(codec, values);
}

std::string optimizers_keeping(const std::string& entry) {
  GenericDict one = make_string_dict();
  one.insert(entry, at::zeros({1}));
  std::vector<std::string> names;
  for (const auto& codec : built_in_codecs()) {
    if (not_kept(codec, one).empty()) names.push_back(codec.name);
  }
  register_muon_once();
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const auto& [type, codec] : r.codecs) {
      if (not_kept(codec, one).empty()) names.push_back(codec.name);
    }
  }
  std::string text;
  for (size_t i = 0; i < names.size(); ++i) {
    text += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  }
  return text;
}

const OptimizerCodec* find_codec(const optim::Optimizer& optimizer) {
  const auto& codecs = built_in_codecs();
  const auto& type = typeid(optimizer);
  if (type == typeid(optim::Adam)) return &codecs[0];
  if (type == typeid(optim::AdamW)) return &codecs[1];
  if (type == typeid(optim::SGD)) return &codecs[2];
  if (type == typeid(optim::RMSprop)) return &codecs[3];
  if (type == typeid(optim::Adagrad)) return &codecs[4];
  register_muon_once();
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.codecs.find(std::type_index(type));
  return it == r.codecs.end() ? nullptr : &it->second;
}

const OptimizerCodec& codec_for(const optim::Optimizer& optimizer) {
  const OptimizerCodec* codec = find_codec(optimizer);
  SHARDOPT_CHECK(codec, "state_dict(), consolidation and state migration need to know how the optimizer's state "
                 "is laid out: shardopt knows Adam, AdamW, SGD, RMSprop, Adagrad and Muon, and any class registered "
                 "with shardopt::register_optimizer; the wrapped optimizer is ",
                 c10::demangle(typeid(optimizer).name()), ", which is not registered");
  return *codec;
}

bool is_state_tensor(const GenericDict::iterator::value_type& entry) {
  return entry.value().isTensor() && entry.key().toStringRef() != "step";
}

GenericDict with_own_storage(const GenericDict& encoded) {
  GenericDict out = make_string_dict();
  for (const auto& v : encoded) {
    if (is_state_tensor(v)) {
      const at::Tensor& t = v.value().toTensor();
      out.insert(v.key(), t.clone(at::MemoryFormat::Contiguous));
    } else {
      out.insert(v.key(), v.value());
    }
  }
  return out;
}

int64_t state_tensor_bytes(const GenericDict& state) {
  int64_t bytes = 0;
  for (const auto& v : state) {
    if (is_state_tensor(v)) bytes += v.value().toTensor().nbytes();
  }
  return bytes;
}

}  // namespace shardopt::detail

namespace shardopt {

bool knows_optimizer(const torch::optim::Optimizer& optimizer) {
  return detail::find_codec(optimizer) != nullptr;
}

}  // namespace shardopt
