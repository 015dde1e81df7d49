// Anchor translation unit for the precompiled-header targets.
namespace hp_pch { int anchor = 0; }
