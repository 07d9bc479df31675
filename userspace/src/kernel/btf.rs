//! Just enough of the kernel's BTF (/sys/kernel/btf/vmlinux) to find a struct
//! member's offset: task_struct's `pid` and CPU, which the raw scheduler tracepoints
//! read from the task pointers the kernel hands them.

const BTF_MAGIC: u16 = 0xeb9f;

/// The running kernel's BTF.
pub const VMLINUX: &std::ffi::CStr = c"/sys/kernel/btf/vmlinux";

/// VMLINUX as a path.
pub fn vmlinux_path() -> &'static std::path::Path {
    std::path::Path::new(VMLINUX.to_str().expect("ASCII"))
}

/// Byte offset of `member` in `struct name`, None when absent or unreadable.
pub fn member_offset(data: &[u8], name: &str, member: &str) -> Option<u32> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(data.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(data.get(o..o + 4)?.try_into().ok()?));
    if u16_at(0)? != BTF_MAGIC {
        return None;
    }
    let hdr_len = u32_at(4)? as usize;
    let (type_off, type_len) = (u32_at(8)? as usize, u32_at(12)? as usize);
    let str_off = hdr_len + u32_at(16)? as usize;
    let name_at = |off: u32| -> Option<&[u8]> {
        let start = str_off + off as usize;
        let rest = data.get(start..)?;
        Some(&rest[..rest.iter().position(|&b| b == 0)?])
    };
    let mut p = hdr_len + type_off;
    let end = p + type_len;
    while p + 12 <= end {
        let (name_off, info) = (u32_at(p)?, u32_at(p + 4)?);
        let vlen = (info & 0xffff) as usize;
        let kind = (info >> 24) & 0x1f;
        let kind_flag = info >> 31 == 1;
        p += 12;
        let extra = match kind {
            1 | 14 | 17 => 4,     // INT, VAR, DECL_TAG
            3 => 12,              // ARRAY
            4 | 5 => 12 * vlen,   // STRUCT, UNION
            6 | 13 => 8 * vlen,   // ENUM, FUNC_PROTO
            15 | 19 => 12 * vlen, // DATASEC, ENUM64
            2 | 7..=12 | 16 | 18 => 0,
            _ => return None, // a kind this parser does not know: stop, not guess
        };
        if kind == 4 && name_at(name_off)? == name.as_bytes() {
            for i in 0..vlen {
                let m = p + 12 * i;
                if name_at(u32_at(m)?)? == member.as_bytes() {
                    let off = u32_at(m + 8)?;
                    let bits = if kind_flag { off & 0xff_ffff } else { off };
                    return Some(bits / 8);
                }
            }
            return None;
        }
        p += extra;
    }
    None
}

/// task_struct's `pid` offset and the offset of the CPU it last ran on (task_cpu():
/// `thread_info.cpu` since 5.16 where thread_info lives in the task, `cpu` in the
/// task before), on the running kernel.
pub fn task_offsets() -> Option<(u32, u32)> {
    let data = std::fs::read(vmlinux_path()).ok()?;
    offsets_in(&data)
}

fn offsets_in(data: &[u8]) -> Option<(u32, u32)> {
    let pid = member_offset(data, "task_struct", "pid").filter(|&o| o > 0)?;
    let cpu = member_offset(data, "task_struct", "cpu").or_else(|| {
        Some(
            member_offset(data, "task_struct", "thread_info")?
                + member_offset(data, "thread_info", "cpu")?,
        )
    })?;
    Some((pid, cpu)).filter(|&(_, c)| c > 0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn finds_task_struct_pid_on_this_kernel() {
        let Ok(data) = std::fs::read(super::vmlinux_path()) else {
            toffload_tests::harness::skip("no /sys/kernel/btf/vmlinux");
            return;
        };
        let pid = super::member_offset(&data, "task_struct", "pid").expect("pid");
        let tgid = super::member_offset(&data, "task_struct", "tgid").expect("tgid");
        // pid_t pid; pid_t tgid; adjacent in every kernel since 2.6.
        assert_eq!(tgid, pid + 4);
        assert!(pid > 0);
        assert_eq!(
            super::member_offset(&data, "task_struct", "no_such_member"),
            None
        );
    }

    #[test]
    fn finds_the_task_cpu_on_this_kernel() {
        let Ok(data) = std::fs::read(super::vmlinux_path()) else {
            toffload_tests::harness::skip("no /sys/kernel/btf/vmlinux");
            return;
        };
        let (pid, cpu) = super::offsets_in(&data).expect("offsets");
        assert_eq!(Some(pid), super::member_offset(&data, "task_struct", "pid"));
        // Either form, within the task and clear of pid.
        assert!(cpu > 0 && cpu != pid, "cpu at {cpu}, pid at {pid}");
    }

    #[test]
    fn rejects_garbage() {
        assert_eq!(super::member_offset(b"not btf at all", "a", "b"), None);
        assert_eq!(super::member_offset(&[], "a", "b"), None);
    }
}
