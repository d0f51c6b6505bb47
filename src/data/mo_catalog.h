// Reader for GNU gettext binary message catalogs (.mo files).
//
// Format (GNU gettext manual, "The Format of GNU MO Files"): a 28-byte header
//   magic 0x950412de | revision | N | O (original table) | T (translation table)
//   | S (hash table size) | H (hash table offset)
// then two tables of N (length, offset) pairs of 32-bit words, each pointing at a
// NUL-terminated string. All words use the byte order of the writing machine; the
// magic tells which one, so both little- and big-endian files are read.
//
// A catalog is untrusted input: every header field, table entry and string is checked
// against the file size before it is used, nothing is allocated from an unchecked
// count, and any violation throws nebula::DataError("<name>: <reason with values>").
// Strings are returned in UTF-8: a catalog whose header declares another charset
// (e.g. ISO-8859-1, EUC-JP; "charset=" in the header entry's Content-Type) is converted
// with iconv, and an unknown charset or a byte sequence invalid in it is a DataError.
// UTF-8 catalogs are returned byte for byte (not validated).
// The hash table is not used (entries are returned in file order) but its bounds are
// still checked. Revision 1 files (system-dependent strings) are accepted; only their
// static strings are returned, which is what every msgfmt-written catalog carries for
// ordinary messages.
//
// Thread safety: free functions without shared state; safe to call concurrently.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace nebula::data {

// One catalog entry. The original string of a .mo entry is
//   [msgctxt '\x04'] msgid ['\0' msgid_plural]
// and the translation is the '\0'-separated list of plural forms.
struct MoEntry {
  std::string context;                    // msgctxt, empty if none
  std::string msgid;                      // the English (source) text; never empty
  std::string msgid_plural;               // empty if the entry has no plural form
  std::vector<std::string> translations;  // [0] = singular; never empty (may hold "")

  bool operator==(const MoEntry&) const = default;
};

// Parses catalog bytes. `name_for_errors` (usually the path) starts every error
// message. The header entry (empty msgid, which carries the catalog's metadata) and
// any other entry whose msgid is empty are skipped. Throws nebula::DataError.
std::vector<MoEntry> parse_mo(std::string_view bytes, const std::string& name_for_errors);

// Reads and parses the file at `path`. An unreadable file throws nebula::DataError
// naming the path and strerror(errno); a corrupt one, as parse_mo.
std::vector<MoEntry> read_mo_file(const std::string& path);

}  // namespace nebula::data
