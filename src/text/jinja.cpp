// jinja::Template: the public entry points, wiring the stages together: lex
// (jinja_lexer.cpp) and parse (jinja_parser.cpp) when constructed, evaluate
// (jinja_eval.cpp) when rendered.
#include "text/jinja.h"

#include "text/jinja_internal.h"

namespace talon::text::jinja {

Template::Template(std::string_view source, std::string name, Options opts) : impl_(std::make_unique<Impl>()) {
  impl_->name = std::move(name);
  impl_->opts = opts;
  impl_->body = parse(lex(source, impl_->name, opts), impl_->name);
}
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;
const std::string& Template::name() const { return impl_->name; }

std::string Template::render(const Dict& context) const { return render_impl(*impl_, context); }

}  // namespace talon::text::jinja
