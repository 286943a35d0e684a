/* qemu_insn_count.c - a qemu-user TCG plugin that counts the guest instructions a program executes and prints the
 * total to stderr at exit ("insns: N"). Debian's qemu-user loads plugins (-plugin) but ships none, and the plugin
 * header is not packaged: the few declarations of QEMU's plugin API version 1 (QEMU 4.2 to 8.0) that this uses are
 * written out here. tools/dev/cross_arm64.sh insn builds it (cc -shared -fPIC) and reports instructions per value
 * of each kernel from two runs' difference.
 * Counting is inline (one add per translated block executed) and not atomic: single-threaded programs only. */
#include <inttypes.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef uint64_t qemu_plugin_id_t;
struct qemu_plugin_tb;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };

#define EXPORT __attribute__((visibility("default")))
EXPORT int qemu_plugin_version = 1;

void   qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, void (*cb)(qemu_plugin_id_t, struct qemu_plugin_tb *));
void   qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb * tb, enum qemu_plugin_op op, void * ptr,
                                                uint64_t imm);
void   qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, void (*cb)(qemu_plugin_id_t, void *), void * userdata);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb * tb);

static uint64_t insns;

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb * tb) {
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &insns, qemu_plugin_tb_n_insns(tb));
}

static void report(qemu_plugin_id_t id, void * userdata) { fprintf(stderr, "insns: %" PRIu64 "\n", insns); }

EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const void * info, int argc, char ** argv) {
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
    qemu_plugin_register_atexit_cb(id, report, NULL);
    return 0;
}
