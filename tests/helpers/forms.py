"""The lines of codegen's form block (`attncc.codegen.generate.form_text`) that mark a unit's
FA3 form, for tests that check which form a unit was generated in."""
PAIRED = "constexpr bool paired() { return true; }"
LOW_PRESSURE = "constexpr int pressure_level() { return 1; }"
