// The one instantiation of rpe::make_term in a program: rpe's own programs (tests, tools,
// benchmarks) link the object library rpe_make_term, a user's program the installed target
// rpe::make_term (which adds this file to it); both define RPE_EXTERN_MAKE_TERM, so each
// translation unit that calls make_term skips its instantiation (see <rpe/make_term.hpp>).
#include <rpe/make_term.hpp>

template std::unique_ptr<rpe::any_term<float>> rpe::make_term<float>(const rpe::term_spec&);
template std::unique_ptr<rpe::any_term<double>> rpe::make_term<double>(const rpe::term_spec&);
template std::unique_ptr<rpe::any_term<float>> rpe::make_term<float>(const rpe::family_spec&, const rpe::term_options&,
                                                                     rpe::grid_extent);
template std::unique_ptr<rpe::any_term<double>> rpe::make_term<double>(const rpe::family_spec&, const rpe::term_options&,
                                                                       rpe::grid_extent);
