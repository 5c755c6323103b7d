//! `TensorReader`: statistics of CPU tensors read straight from their memory, no torch op.
//!
//! On a fast CPU step each torch op the collector adds costs far more than the arithmetic of its
//! small reductions (the step has evicted the dispatcher's code from the caches).
//! So for a *readable* tensor, the reader takes the pointer `tensor.data_ptr()` and the count
//! `tensor.numel()`, views them as a slice of `f32`, `f64`, `f16` or `bf16`, and hands it to the
//! kernels of [`neuraldbg_core::measure`]; results go into numpy arrays the caller gives.
//!
//! A tensor is readable when its type is exactly one of the types given to the constructor
//! (subclasses such as `DTensor` or `FakeTensor` are not), its dtype is one of the four given
//! dtype objects (by identity), `t.is_cpu` and `t.is_contiguous()` are `True`, and it is empty
//! or has a non-null `data_ptr()` (which already includes the storage offset). Any exception
//! while checking makes it unreadable, and the methods answer `False`/`None` so that the
//! collector falls back to its torch path; only misuse (an output array of the wrong length,
//! layout or dtype) raises.
//!
//! Given torch's DLPack exporter (`torch._C._to_dlpack`), the reader learns all of that in one
//! call instead of five (dtype, device, shape, strides and address of a `DLManagedTensor`; a
//! tensor is then readable when it is on the CPU, of a float type of 16, 32 or 64 bits or
//! bfloat16, one lane, and compact row-major): the per-tensor checks were most of the cost of
//! reading the gradients of a deep model on every step. The capsule keeps a reference to the
//! tensor while the elements are read and its destructor (torch's, the capsule not being
//! consumed) releases it. Not `Tensor.__dlpack__`: that is a Python method, slower than the
//! checks it would replace.
//!
//! Safety contract: a readable tensor's `numel` elements lie contiguously from `data_ptr()` in
//! memory its storage owns. The tensor is referenced by the method's arguments and the GIL is
//! held throughout, and each slice lives only inside one pure Rust computation
//! ([`TensorReader::with_elements`]): no Python code runs while it exists, so nothing can free
//! or resize the storage. The caller must not let another thread write the tensors meanwhile
//! (torch kernels release the GIL); the collector calls the reader from the training thread
//! between steps' ops, the same contract as numpy's buffer protocol. The reader trusts what the
//! accepted types answer: the constructor must be given torch's own tensor types
//! (`torch.Tensor`, `torch.nn.Parameter`), not a class whose `data_ptr` could say anything.
//! Results are written to the caller's arrays only after every tensor was read
//! ([`write_out`]), so an output array may even share memory with a tensor it measures.

use half::{bf16, f16};
use neuraldbg_core::measure::{self, Element, OutputProbe, Slope};
use numpy::{PyReadwriteArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyCapsule, PyList, PyString, PyTuple};
use std::ffi::c_void;

/// DLPack's `DLDevice` (dlpack.h).
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// DLPack's `DLDataType`.
#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// DLPack's `DLTensor`.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// DLPack's (unversioned) `DLManagedTensor`, what a capsule named `dltensor` holds.
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// DLPack 1.3's `DLPackDLTensorFromPyObjectNoSync`: fills a caller-owned `DLTensor` that views
/// the Python object's tensor without owning it (valid while the object is alive and unchanged,
/// "until control returns" to Python); 0 on success, else -1 with a Python error set.
type DlTensorFromPyObject = unsafe extern "C" fn(*mut c_void, *mut DlTensor) -> i32;

/// DLPack 1.3's `DLPackExchangeAPI` (what torch's `Tensor.__dlpack_c_exchange_api__`, a capsule
/// named `dlpack_exchange_api`, points to): a version header, then function pointers, each
/// possibly null. Only `dltensor_from_py_object_no_sync` is used.
#[repr(C)]
struct DlExchangeApi {
    major: u32,
    minor: u32,
    prev_api: *const c_void,
    managed_tensor_allocator: *const c_void,
    managed_tensor_from_py_object_no_sync: *const c_void,
    managed_tensor_to_py_object_no_sync: *const c_void,
    dltensor_from_py_object_no_sync: Option<DlTensorFromPyObject>,
    current_work_stream: *const c_void,
}

/// `kDLCPU`, `kDLFloat`, `kDLBfloat`.
const DL_CPU: i32 = 1;
const DL_FLOAT: u8 = 2;
const DL_BFLOAT: u8 = 4;

/// A readable tensor's elements, by dtype.
enum Elements<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
}

/// Runs `$body` with `$xs` bound to the slice of whatever element type `$e` holds.
macro_rules! dispatch {
    ($e:expr, $xs:ident => $body:expr) => {
        match $e {
            Elements::F32($xs) => $body,
            Elements::F64($xs) => $body,
            Elements::F16($xs) => $body,
            Elements::Bf16($xs) => $body,
        }
    };
}

/// Asks the CPU to start loading the first bytes of a CPU tensor's elements (up to
/// [`PREFETCH_BYTES`]) while other work runs. A model's gradients are thousands of separate small
/// allocations: reading them one after the other, each begins with cache and TLB misses that
/// the hardware prefetcher cannot foresee (`bench/callbacks.py --grads-made` measures it). Only a
/// hint: it never faults and changes nothing, whatever the address; a no-op on other
/// architectures.
fn prefetch(dl: &DlTensor) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        if dl.device.device_type != DL_CPU || dl.data.is_null() || dl.ndim < 0 || dl.shape.is_null()
        {
            return;
        }
        let ndim = dl.ndim as usize;
        // SAFETY: DLPack's contract: `shape` points to `ndim` integers, alive with the tensor
        // the caller holds.
        let shape = unsafe { std::slice::from_raw_parts(dl.shape, ndim) };
        let numel = shape
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(u64::try_from(d).ok()?));
        let bytes = numel.map_or(0, |n| {
            n.saturating_mul(u64::from(dl.dtype.bits).div_ceil(8))
        });
        let start = (dl.data as usize).wrapping_add(dl.byte_offset as usize);
        let mut at = 0;
        while at < bytes.min(PREFETCH_BYTES) {
            // SAFETY: a prefetch is a hint, it cannot fault or change memory.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(at as usize) as *const i8) };
            at += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = dl;
}

/// How much of the next gradient [`prefetch`] asks for: a 64x64 `f32` matrix; the hardware
/// prefetcher streams the rest of a larger one.
const PREFETCH_BYTES: u64 = 16 * 1024;

/// `len` elements of `T` from address `ptr`, `None` when the address is misaligned or the span
/// too long for a slice.
///
/// # Safety
/// `ptr` must be non-null and point to `len` initialised elements of `T` that stay alive and
/// unwritten for `'a`.
unsafe fn slice_at<'a, T>(ptr: usize, len: usize) -> Option<&'a [T]> {
    let bytes = len.checked_mul(size_of::<T>())?;
    if ptr == 0
        || ptr % align_of::<T>() != 0
        || bytes > isize::MAX as usize
        || ptr.checked_add(bytes).is_none()
    {
        return None;
    }
    // SAFETY: non-null and aligned (checked above), the span fits `isize` and does not wrap
    // (checked above); validity and lifetime are the caller's contract.
    Some(unsafe { std::slice::from_raw_parts(ptr as *const T, len) })
}

/// The item `i` of a sequence (lists and tuples without building an index object).
fn item<'py>(seq: &Bound<'py, PyAny>, i: usize) -> PyResult<Bound<'py, PyAny>> {
    if let Ok(list) = seq.cast::<PyList>() {
        list.get_item(i)
    } else if let Ok(tuple) = seq.cast::<PyTuple>() {
        tuple.get_item(i)
    } else {
        seq.get_item(i)
    }
}

/// The C-contiguous float32 contents of an output array given by the caller.
fn out_slice<'a>(name: &str, a: &'a mut PyReadwriteArrayDyn<'_, f32>) -> PyResult<&'a mut [f32]> {
    a.as_slice_mut().map_err(|_| {
        PyValueError::new_err(format!(
            "{name} must be a C-contiguous writable float32 array"
        ))
    })
}

/// Copies `values` into an output array. Results are gathered in a buffer of ours and written
/// only once every tensor has been read: an output array that shares memory with one of the
/// tensors (`torch.from_numpy(out)`) is then never borrowed mutably while a tensor slice, or
/// Python code, is alive.
fn write_out(name: &str, a: &mut PyReadwriteArrayDyn<'_, f32>, values: &[f32]) -> PyResult<()> {
    let out = out_slice(name, a)?;
    if out.len() != values.len() {
        return Err(PyValueError::new_err(format!(
            "{name} has the wrong length"
        )));
    }
    out.copy_from_slice(values);
    Ok(())
}

/// Statistics of CPU tensors read straight from their memory (no torch op).
/// Bits of [`TensorReader::grad_norms`]'s answer (also `_native.GRAD_NONFINITE`, ...).
pub(crate) const GRAD_NONFINITE: i32 = 1;
pub(crate) const GRAD_ZERO: i32 = 2;
pub(crate) const GRAD_MISSING: i32 = 4;

#[pyclass(module = "neuraldbg._native", name = "TensorReader")]
pub struct TensorReader {
    /// The exact tensor types accepted.
    types: Vec<Py<PyAny>>,
    /// `torch.float32`, `torch.float64`, `torch.float16`, `torch.bfloat16`.
    dtypes: [Py<PyAny>; 4],
    /// Interned attribute and method names.
    dtype: Py<PyString>,
    is_cpu: Py<PyString>,
    is_contiguous: Py<PyString>,
    numel: Py<PyString>,
    data_ptr: Py<PyString>,
    shape: Py<PyString>,
    grad: Py<PyString>,
    /// torch's DLPack exporter (`torch._C._to_dlpack`), when given.
    to_dlpack: Option<Py<PyAny>>,
    /// torch's non-owning DLPack view of a `torch.Tensor` (DLPack 1.3's exchange API), when
    /// given: no allocation, no capsule, no Python call a tensor; and the capsule holding it.
    view: Option<DlTensorFromPyObject>,
    exchange: Option<Py<PyAny>>,
    /// Reused buffers: a tensor's shape, per-unit maxima, per-column flags.
    dims: Vec<usize>,
    units: Vec<f64>,
    cols: Vec<bool>,
}

impl std::fmt::Debug for TensorReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorReader")
            .field("types", &self.types.len())
            .field("exchange", &self.exchange.is_some())
            .finish_non_exhaustive()
    }
}

impl TensorReader {
    /// max |x| over a readable tensor (NaN when it has no element), else None.
    pub(crate) fn abs_max(&mut self, t: &Bound<'_, PyAny>) -> Option<f64> {
        self.with_elements(
            t,
            false,
            |e, _| dispatch!(e, xs => if xs.is_empty() { f64::NAN } else { measure::abs_max(xs) }),
        )
    }

    /// The exchange API's non-owning view of `t` when `t` is an exact `torch.Tensor` it can
    /// view (a CPU or GPU tensor without a pending conjugation, ...), else None (and the
    /// refusal's error cleared). The view is valid while `t` is alive and no Python code runs.
    fn view_of(&self, t: &Bound<'_, PyAny>) -> Option<DlTensor> {
        let view = self.view?;
        if !t.get_type().is(&self.types[0]) {
            return None;
        }
        let mut dl = DlTensor {
            data: std::ptr::null_mut(),
            device: DlDevice {
                device_type: 0,
                device_id: 0,
            },
            ndim: 0,
            dtype: DlDataType {
                code: 0,
                bits: 0,
                lanes: 0,
            },
            shape: std::ptr::null(),
            strides: std::ptr::null(),
            byte_offset: 0,
        };
        // SAFETY: torch's function for its own exact tensor type (`types[0]`, checked above),
        // called with the GIL held on a live object; it writes only `dl`.
        if unsafe { view(t.as_ptr().cast(), &raw mut dl) } == 0 {
            return Some(dl);
        }
        let _ = PyErr::take(t.py()); // (not viewable this way: the exporter says why not)
        None
    }

    /// Runs `f` over the elements of `t` if it is a readable tensor (`None` otherwise, and on
    /// any exception while checking). With `shape`, `self.dims` gets the tensor's shape first.
    fn with_elements<R>(
        &mut self,
        t: &Bound<'_, PyAny>,
        shape: bool,
        f: impl FnOnce(Elements<'_>, &mut Self) -> R,
    ) -> Option<R> {
        let py = t.py();
        let ty = t.get_type();
        if !self.types.iter().any(|x| ty.is(x)) {
            return None;
        }
        if let Some(dl) = self.view_of(t) {
            // SAFETY: `dl` views `t`'s tensor, alive (borrowed for this whole function) and
            // unchanged: no Python code runs until `f` has returned.
            return unsafe { self.with_dltensor(&dl, f) };
        }
        if let Some(export) = &self.to_dlpack {
            let capsule = export.bind(py).call1((t,)).ok()?;
            return self.with_dlpack(&capsule, f);
        }
        let dtype = t.getattr(self.dtype.bind(py)).ok()?;
        let kind = self.dtypes.iter().position(|d| dtype.is(d))?;
        if !t
            .getattr(self.is_cpu.bind(py))
            .ok()?
            .extract::<bool>()
            .ok()?
            || !t
                .call_method0(self.is_contiguous.bind(py))
                .ok()?
                .extract::<bool>()
                .ok()?
        {
            return None;
        }
        let numel: usize = t.call_method0(self.numel.bind(py)).ok()?.extract().ok()?;
        if shape {
            let dims = t.getattr(self.shape.bind(py)).ok()?;
            let dims = dims.cast::<PyTuple>().ok()?;
            self.dims.clear();
            for d in dims.iter() {
                self.dims.push(d.extract().ok()?);
            }
            if self.dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d)) != Some(numel) {
                return None;
            }
        }
        let ptr: usize = if numel == 0 {
            0
        } else {
            t.call_method0(self.data_ptr.bind(py))
                .ok()?
                .extract()
                .ok()?
        };
        if numel > 0 && ptr == 0 {
            return None;
        }
        // SAFETY (all four arms): `t` is a CPU tensor of exactly a torch tensor type (no
        // subclass overriding these answers), of this dtype, contiguous, so its `numel`
        // elements lie one after another from `data_ptr()` (storage offset included) inside
        // its storage. `t` is borrowed from the caller's arguments and the GIL is held, and
        // the slice lives only inside `f`, pure Rust code that runs no Python: nothing can
        // free, resize or (from Python) write the storage while it exists. Writes from other
        // threads are excluded by the module's contract.
        let elements = if numel == 0 {
            match kind {
                0 => Elements::F32(&[]),
                1 => Elements::F64(&[]),
                2 => Elements::F16(&[]),
                _ => Elements::Bf16(&[]),
            }
        } else {
            match kind {
                0 => Elements::F32(unsafe { slice_at(ptr, numel) }?),
                1 => Elements::F64(unsafe { slice_at(ptr, numel) }?),
                2 => Elements::F16(unsafe { slice_at(ptr, numel) }?),
                _ => Elements::Bf16(unsafe { slice_at(ptr, numel) }?),
            }
        };
        Some(f(elements, self))
    }

    /// [`Self::with_elements`] over what torch's DLPack exporter answered for the tensor
    /// (`self.dims` always gets its shape).
    fn with_dlpack<R>(
        &mut self,
        capsule: &Bound<'_, PyAny>,
        f: impl FnOnce(Elements<'_>, &mut Self) -> R,
    ) -> Option<R> {
        let capsule = capsule.cast::<PyCapsule>().ok()?;
        let managed = capsule.pointer_checked(Some(c"dltensor")).ok()?;
        // SAFETY: a valid capsule named "dltensor" holds a `DLManagedTensor` (DLPack's
        // contract), which stays alive and unchanged until the capsule's destructor runs; the
        // capsule is borrowed for this whole function and no Python code runs meanwhile.
        let dl = unsafe { &managed.cast::<DlManagedTensor>().as_ref().dl_tensor };
        // SAFETY: as just said, `dl` and what it points to outlive this call.
        unsafe { self.with_dltensor(dl, f) }
    }

    /// [`Self::with_elements`] over a `DLTensor` (`self.dims` always gets its shape).
    ///
    /// # Safety
    /// `dl`, its `shape` and `strides` and the memory its `data` points to must stay alive and
    /// unwritten while this runs (no Python code runs in it).
    unsafe fn with_dltensor<R>(
        &mut self,
        dl: &DlTensor,
        f: impl FnOnce(Elements<'_>, &mut Self) -> R,
    ) -> Option<R> {
        if dl.device.device_type != DL_CPU || dl.dtype.lanes != 1 {
            return None;
        }
        let kind = match (dl.dtype.code, dl.dtype.bits) {
            (DL_FLOAT, 32) => 0,
            (DL_FLOAT, 64) => 1,
            (DL_FLOAT, 16) => 2,
            (DL_BFLOAT, 16) => 3,
            _ => return None,
        };
        let ndim = usize::try_from(dl.ndim).ok()?;
        let (shape, strides): (&[i64], Option<&[i64]>) = if ndim == 0 {
            (&[], None)
        } else if dl.shape.is_null() {
            return None;
        } else {
            // SAFETY: DLPack's contract: `shape` (and `strides` when not null) point to `ndim`
            // integers owned by the managed tensor, alive as long as it is (see above).
            unsafe {
                (
                    std::slice::from_raw_parts(dl.shape, ndim),
                    (!dl.strides.is_null()).then(|| std::slice::from_raw_parts(dl.strides, ndim)),
                )
            }
        };
        self.dims.clear();
        let mut numel = 1usize;
        for &d in shape {
            let d = usize::try_from(d).ok()?;
            numel = numel.checked_mul(d)?;
            self.dims.push(d);
        }
        if let Some(strides) = strides.filter(|_| numel > 0) {
            // Compact row-major (NULL strides say so too); a dimension of size 1 may have any
            // stride, as `is_contiguous()` allows.
            let mut expected = 1i64;
            for (&d, &s) in shape.iter().zip(strides).rev() {
                if d != 1 && s != expected {
                    return None;
                }
                expected = expected.checked_mul(d)?;
            }
        }
        let ptr = (dl.data as usize).checked_add(usize::try_from(dl.byte_offset).ok()?)?;
        if numel > 0 && ptr == 0 {
            return None;
        }
        // SAFETY (all four arms): a CPU tensor of this element type, compact row-major, so its
        // `numel` elements lie one after another from `data + byte_offset` in memory the
        // managed tensor keeps alive (it holds a reference to the tensor) until the capsule,
        // borrowed for this whole function, is destroyed. The slice lives only inside `f`,
        // pure Rust code that runs no Python; writes from other threads are excluded by the
        // module's contract.
        let elements = if numel == 0 {
            match kind {
                0 => Elements::F32(&[]),
                1 => Elements::F64(&[]),
                2 => Elements::F16(&[]),
                _ => Elements::Bf16(&[]),
            }
        } else {
            match kind {
                0 => Elements::F32(unsafe { slice_at(ptr, numel) }?),
                1 => Elements::F64(unsafe { slice_at(ptr, numel) }?),
                2 => Elements::F16(unsafe { slice_at(ptr, numel) }?),
                _ => Elements::Bf16(unsafe { slice_at(ptr, numel) }?),
            }
        };
        Some(f(elements, self))
    }

    /// `getattr(x, attr)` if `attr` is given, else `x`.
    fn target<'py>(
        x: Bound<'py, PyAny>,
        attr: Option<&Bound<'py, PyString>>,
    ) -> Option<Bound<'py, PyAny>> {
        match attr {
            Some(a) => x.getattr(a).ok(),
            None => Some(x),
        }
    }
}

/// The activation row of one probe over elements of any type.
fn activation<T: Element>(
    xs: &[T],
    dims: &[usize],
    probe: &OutputProbe,
    units: &mut Vec<f64>,
    row: &mut [f32],
) {
    let r = measure::activation(xs, dims, probe, units);
    row[0] = r.absmax as f32;
    if let Some(v) = r.saturation {
        row[1] = v as f32;
    }
    if let Some(v) = r.dead {
        row[2] = v as f32;
    }
    if let Some(v) = r.slope {
        row[3] = v as f32;
    }
    row[4] = r.samples_per_unit as f32;
}

/// `dltensor_from_py_object_no_sync` of a DLPack exchange API capsule of version 1.3 or later,
/// None for anything else.
fn exchange_view(capsule: &Bound<'_, PyAny>) -> Option<DlTensorFromPyObject> {
    let capsule = capsule.cast::<PyCapsule>().ok()?;
    let api = capsule.pointer_checked(Some(c"dlpack_exchange_api")).ok()?;
    // SAFETY: a capsule of this name points to a `DLPackExchangeAPI`, which its producer keeps
    // for the process's life (torch: a static singleton); its header says which version.
    let api = unsafe { api.cast::<DlExchangeApi>().as_ref() };
    (api.major == 1 && api.minor >= 3)
        .then_some(api.dltensor_from_py_object_no_sync)
        .flatten()
}

#[pymethods]
impl TensorReader {
    #[new]
    #[pyo3(signature = (tensor_types, float32, float64, float16, bfloat16, to_dlpack=None, exchange=None))]
    #[allow(clippy::too_many_arguments)] // (torch's four dtypes, each a parameter)
    fn new(
        py: Python<'_>,
        tensor_types: &Bound<'_, PyTuple>,
        float32: Py<PyAny>,
        float64: Py<PyAny>,
        float16: Py<PyAny>,
        bfloat16: Py<PyAny>,
        to_dlpack: Option<Py<PyAny>>,
        exchange: Option<Py<PyAny>>,
    ) -> Self {
        let name = |s: &str| PyString::intern(py, s).unbind();
        Self {
            types: tensor_types.iter().map(Bound::unbind).collect(),
            dtypes: [float32, float64, float16, bfloat16],
            dtype: name("dtype"),
            is_cpu: name("is_cpu"),
            is_contiguous: name("is_contiguous"),
            numel: name("numel"),
            data_ptr: name("data_ptr"),
            shape: name("shape"),
            grad: name("grad"),
            to_dlpack,
            view: exchange.as_ref().and_then(|e| exchange_view(e.bind(py))),
            exchange,
            dims: Vec::new(),
            units: Vec::new(),
            cols: Vec::new(),
        }
    }

    /// `out[i]` = the L2 norm of `items[i]` (or of `getattr(items[i], attr)`), `missing` where
    /// that is None. False as soon as a tensor is unreadable (`out` then unspecified).
    #[pyo3(
        signature = (items, out, attr=None, missing=-1.0),
        text_signature = "(self, /, items, out, attr=None, missing=-1.0)"
    )]
    fn norms(
        &mut self,
        items: &Bound<'_, PyAny>,
        mut out: PyReadwriteArrayDyn<'_, f32>,
        attr: Option<&Bound<'_, PyString>>,
        missing: f32,
    ) -> PyResult<bool> {
        if items.len()? != out.len() {
            return Err(PyValueError::new_err("out must have one entry per item"));
        }
        let mut values = Vec::with_capacity(out.len());
        for x in items.try_iter()? {
            let Some(t) = Self::target(x?, attr) else {
                return Ok(false);
            };
            if t.is_none() {
                values.push(missing);
                continue;
            }
            match self.with_elements(&t, false, |e, _| dispatch!(e, xs => measure::l2_norm(xs))) {
                Some(n) => values.push(n as f32),
                None => return Ok(false),
            }
        }
        write_out("out", &mut out, &values)?;
        Ok(true)
    }

    /// `out[i]` = the L2 norm of `params[i].grad`, `missing` where that is None, and what the
    /// norms hold: bit 1 some norm is not finite, bit 2 some is exactly zero, bit 4 some
    /// gradient is missing (0: every one present, finite, non-zero); -1 as soon as a gradient
    /// is unreadable (the arrays then unspecified). With `rows` and `cols`, also the shares of
    /// exactly-zero rows and columns of each gradient, as `zero_shares` gives them, in the
    /// same pass.
    #[pyo3(
        signature = (params, out, missing=-1.0, rows=None, cols=None),
        text_signature = "(self, /, params, out, missing=-1.0, rows=None, cols=None)"
    )]
    pub(crate) fn grad_norms(
        &mut self,
        params: &Bound<'_, PyAny>,
        mut out: PyReadwriteArrayDyn<'_, f32>,
        missing: f32,
        rows: Option<PyReadwriteArrayDyn<'_, f32>>,
        cols: Option<PyReadwriteArrayDyn<'_, f32>>,
    ) -> PyResult<i32> {
        let n = params.len()?;
        if n != out.len() {
            return Err(PyValueError::new_err("out must have one entry per item"));
        }
        let mut shares = match (rows, cols) {
            (Some(r), Some(c)) if r.len() == n && c.len() == n => Some((r, c)),
            (None, None) => None,
            _ => {
                return Err(PyValueError::new_err(
                    "rows and cols must be given together, with one entry per item",
                ));
            }
        };
        let attr = self.grad.clone_ref(params.py());
        let attr = attr.bind(params.py());
        // First every `.grad` (any Python code a parameter's attribute may run, runs here),
        // then the reads, which run none: each gradient's view is taken one ahead, and its
        // memory prefetched while the one before is read.
        let mut grads = Vec::with_capacity(n);
        for p in params.try_iter()? {
            let Some(g) = Self::target(p?, Some(attr)) else {
                return Ok(-1);
            };
            grads.push(g);
        }
        let mut values = Vec::with_capacity(n);
        let (mut row_values, mut col_values) = (Vec::new(), Vec::new());
        let mut flags = 0;
        let with_shares = shares.is_some();
        let view_at = |me: &Self, i: usize| {
            grads
                .get(i)
                .filter(|g| !g.is_none())
                .and_then(|g| me.view_of(g))
        };
        let mut next = view_at(self, 0);
        for (i, g) in grads.iter().enumerate() {
            let here = next.take();
            next = view_at(self, i + 1);
            if let Some(dl) = &next {
                prefetch(dl);
            }
            if g.is_none() {
                values.push(missing);
                row_values.push(f32::NAN);
                col_values.push(f32::NAN);
                flags |= GRAD_MISSING;
                continue;
            }
            let read = |e: Elements<'_>, me: &mut Self| {
                let norm = dispatch!(e, xs => measure::l2_norm(xs));
                let zeros = if with_shares {
                    let d = &me.dims;
                    if d.len() < 2 || d.contains(&0) {
                        (f64::NAN, f64::NAN)
                    } else {
                        let inner = d[2..].iter().product();
                        dispatch!(e, xs => measure::zero_shares(xs, d[0], d[1], inner, &mut me.cols))
                    }
                } else {
                    (f64::NAN, f64::NAN)
                };
                (norm, zeros)
            };
            let read = match &here {
                // SAFETY: the view of `g`, alive in `grads`; since it was taken only torch's
                // view function ran (no Python code), so the tensor is as it was.
                Some(dl) => unsafe { self.with_dltensor(dl, read) },
                None => self.with_elements(g, with_shares, read),
            };
            let Some((norm, (zr, zc))) = read else {
                return Ok(-1);
            };
            let norm = norm as f32;
            if !norm.is_finite() {
                flags |= GRAD_NONFINITE;
            } else if norm == 0.0 {
                flags |= GRAD_ZERO;
            }
            values.push(norm);
            row_values.push(zr as f32);
            col_values.push(zc as f32);
        }
        write_out("out", &mut out, &values)?;
        if let Some((r, c)) = shares.as_mut() {
            write_out("rows", r, &row_values)?;
            write_out("cols", c, &col_values)?;
        }
        Ok(flags)
    }

    /// Whether `torch.Tensor`s are read through DLPack's exchange API (a non-owning view: no
    /// capsule a tensor), rather than one `_to_dlpack` capsule each.
    #[getter]
    fn views(&self) -> bool {
        self.view.is_some()
    }

    /// The L2 norm of `item` (or of `getattr(item, attr)`; -1 where that is None), None when
    /// it is not readable.
    #[pyo3(signature = (item, attr=None))]
    pub(crate) fn norm(
        &mut self,
        item: &Bound<'_, PyAny>,
        attr: Option<&Bound<'_, PyString>>,
    ) -> Option<f64> {
        let t = Self::target(item.clone(), attr)?;
        if t.is_none() {
            return Some(-1.0);
        }
        self.with_elements(&t, false, |e, _| dispatch!(e, xs => measure::l2_norm(xs)))
    }

    /// `(min, max, mean, std)` of a readable non-empty tensor (std: population), else None.
    pub(crate) fn stats(&mut self, t: &Bound<'_, PyAny>) -> Option<(f64, f64, f64, f64)> {
        self.with_elements(t, false, |e, _| dispatch!(e, xs => measure::stats(xs)))
            .flatten()
            .map(|s| (s.min, s.max, s.mean, s.std))
    }

    /// The value of a readable one-element tensor, else None.
    pub(crate) fn scalar(&mut self, t: &Bound<'_, PyAny>) -> Option<f64> {
        self.with_elements(
            t,
            false,
            |e, _| dispatch!(e, xs => (xs.len() == 1).then(|| xs[0].to_f64())),
        )
        .flatten()
    }

    /// `out[i]` = max |x| over `items[i]` (`empty` when it has no element). False if an item
    /// is not readable.
    #[pyo3(signature = (items, out, empty=0.0))]
    fn absmax(
        &mut self,
        items: &Bound<'_, PyAny>,
        mut out: PyReadwriteArrayDyn<'_, f32>,
        empty: f32,
    ) -> PyResult<bool> {
        if items.len()? != out.len() {
            return Err(PyValueError::new_err("out must have one entry per item"));
        }
        let mut values = Vec::with_capacity(out.len());
        for t in items.try_iter()? {
            let read = self.with_elements(&t?, false, |e, _| {
                dispatch!(e, xs => if xs.is_empty() { None } else { Some(measure::abs_max(xs)) })
            });
            match read {
                Some(Some(m)) => values.push(m as f32),
                Some(None) => values.push(empty),
                None => return Ok(false),
            }
        }
        write_out("out", &mut out, &values)?;
        Ok(true)
    }

    /// Shares of exactly-zero rows and columns of each tensor of 2 or more dimensions (NaN for
    /// None, fewer dimensions or no element). False if a tensor is unreadable.
    #[pyo3(signature = (items, rows, cols, attr=None))]
    fn zero_shares(
        &mut self,
        items: &Bound<'_, PyAny>,
        mut rows: PyReadwriteArrayDyn<'_, f32>,
        mut cols: PyReadwriteArrayDyn<'_, f32>,
        attr: Option<&Bound<'_, PyString>>,
    ) -> PyResult<bool> {
        let n = items.len()?;
        if rows.len() != n || cols.len() != n {
            return Err(PyValueError::new_err(
                "rows and cols must have one entry per item",
            ));
        }
        let (mut row_values, mut col_values) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for x in items.try_iter()? {
            let Some(t) = Self::target(x?, attr) else {
                return Ok(false);
            };
            let shares = if t.is_none() {
                Some((f64::NAN, f64::NAN))
            } else {
                self.with_elements(&t, true, |e, me| {
                    let d = &me.dims;
                    if d.len() < 2 || d.contains(&0) {
                        return (f64::NAN, f64::NAN);
                    }
                    let inner = d[2..].iter().product();
                    dispatch!(e, xs => measure::zero_shares(xs, d[0], d[1], inner, &mut me.cols))
                })
            };
            let Some((zr, zc)) = shares else {
                return Ok(false);
            };
            row_values.push(zr as f32);
            col_values.push(zc as f32);
        }
        write_out("rows", &mut rows, &row_values)?;
        write_out("cols", &mut cols, &col_values)?;
        Ok(true)
    }

    /// The engine's activation rows: for each probe `(row, unit_axis, center, half, death,
    /// slope)` the statistics of `outs[row]` into `table[5 * row ..][..5]` (entries the probe
    /// does not ask are left alone; None and empty outputs are skipped). False if an output
    /// is unreadable.
    fn activations(
        &mut self,
        outs: &Bound<'_, PyAny>,
        probes: &Bound<'_, PyAny>,
        mut table: PyReadwriteArrayDyn<'_, f32>,
    ) -> PyResult<bool> {
        // Filled in a copy (see `write_out`), the cells a probe does not ask keeping their value.
        let mut cells_of = out_slice("table", &mut table)?.to_vec();
        for p in probes.try_iter()? {
            let (row, unit_axis, center, half, death, slope): (
                usize,
                i64,
                f64,
                Option<f64>,
                bool,
                u8,
            ) = p?.extract()?;
            let slope = match slope {
                0 => None,
                1 => Some(Slope::Tanh),
                2 => Some(Slope::Sigmoid),
                3 => Some(Slope::Softsign),
                _ => {
                    return Err(PyValueError::new_err(
                        "slope must be 0 (none), 1 (tanh), 2 (sigmoid) or 3 (softsign)",
                    ));
                }
            };
            let Some(cells) = cells_of.get_mut(5 * row..5 * row + 5) else {
                return Err(PyValueError::new_err(
                    "table must have 5 entries per probe row",
                ));
            };
            let y = item(outs, row)?;
            if y.is_none() {
                continue;
            }
            let probe = OutputProbe {
                unit_axis,
                center,
                half,
                death,
                slope,
            };
            let done = self.with_elements(&y, true, |e, me| {
                dispatch!(e, xs => if !xs.is_empty() {
                    activation(xs, &me.dims, &probe, &mut me.units, cells);
                });
            });
            if done.is_none() {
                return Ok(false);
            }
        }
        write_out("table", &mut table, &cells_of)?;
        Ok(true)
    }
}

/// The largest magnitude of each recorded layer's output on a sampled host step, read as the
/// layer returns: the layer-class wrapper calls `maxima(index, output)` once per recorded call,
/// with no Python frame of ours per layer. An output the reader cannot read goes to `kept` as
/// `(index, output, None)`, for the collector's torch path. [`OutputMaxima::table`] hands the
/// step's values over as the engine's per-module table.
#[pyclass(module = "neuraldbg._native", name = "OutputMaxima")]
#[derive(Debug)]
pub struct OutputMaxima {
    reader: Py<TensorReader>,
    kept: Py<PyList>,
    /// `(module index, max |x|)` of the outputs read since the last table.
    read: Vec<(usize, f32)>,
}

#[pymethods]
impl OutputMaxima {
    #[new]
    fn new(reader: Py<TensorReader>, kept: Py<PyList>) -> Self {
        Self {
            reader,
            kept,
            read: Vec::new(),
        }
    }

    fn __call__(
        &mut self,
        py: Python<'_>,
        index: usize,
        output: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        // (A reader busy elsewhere cannot happen with the GIL held and no Python run while it
        // reads; were it busy, the output is kept for the torch path instead of a panic.)
        let value = self
            .reader
            .try_borrow_mut(py)
            .ok()
            .and_then(|mut r| r.abs_max(output));
        match value {
            Some(v) => self.read.push((index, v as f32)),
            None => self.kept.bind(py).append((index, output, py.None()))?,
        }
        Ok(())
    }

    fn __len__(&self) -> usize {
        self.read.len()
    }

    /// Forgets the values read.
    fn clear(&mut self) {
        self.read.clear();
    }

    /// The engine's per-module table of `modules` entries: for each value read (and each
    /// `values[k]` at engine module `ranks[k]`, when given), `table[rank[index]]` is the
    /// largest of them, NaN where none was (a NaN gives way to a number, as `np.fmax`); a
    /// module index whose `rank` is negative has no entry. None when no value has an entry.
    /// The values read are forgotten.
    #[pyo3(signature = (rank, modules, values=None, ranks=None))]
    fn table<'py>(
        &mut self,
        py: Python<'py>,
        rank: numpy::PyReadonlyArray1<'_, i64>,
        modules: usize,
        values: Option<numpy::PyReadonlyArray1<'_, f32>>,
        ranks: Option<numpy::PyReadonlyArray1<'_, i64>>,
    ) -> PyResult<Option<Bound<'py, numpy::PyArray1<f32>>>> {
        let rank = rank.as_slice()?;
        let mut table = vec![f32::NAN; modules];
        let mut seen = false;
        let mut put = |r: i64, v: f32| -> PyResult<()> {
            let Ok(r) = usize::try_from(r) else {
                return Ok(());
            };
            let Some(now) = table.get_mut(r) else {
                return Err(PyValueError::new_err("a rank is past the table's end"));
            };
            if now.is_nan() || v > *now {
                *now = v;
            }
            seen = true;
            Ok(())
        };
        match (&values, &ranks) {
            (Some(v), Some(r)) => {
                let (v, r) = (v.as_slice()?, r.as_slice()?);
                if v.len() != r.len() {
                    return Err(PyValueError::new_err(
                        "values and ranks must have the same length",
                    ));
                }
                for (&v, &r) in v.iter().zip(r) {
                    put(r, v)?;
                }
            }
            (None, None) => {}
            _ => {
                return Err(PyValueError::new_err(
                    "values and ranks must be given together",
                ));
            }
        }
        for &(index, v) in &self.read {
            put(rank.get(index).copied().unwrap_or(-1), v)?;
        }
        self.read.clear();
        Ok(seen.then(|| numpy::PyArray1::from_vec(py, table)))
    }
}

/// What the layer-class wrapper does with a call of a recorded layer (`_hooks.make_record`),
/// as one call into the extension instead of a dozen lines of Python a layer: the record
/// `(index, output, args)` appended to `refs` (after clearing it when `index` is `first[0]`,
/// the layer that completes first in a forward pass), keeping what `hold[0]` says: True the
/// output and inputs, False the inputs only, else no tensor, and a callable `hold[0]` is
/// handed the call: [`OutputMaxima`] `(index, output)`, any other `(index, output, args)` (the
/// device path's summaries of each call).
#[pyclass(module = "neuraldbg._native", name = "LayerRecord", frozen)]
#[derive(Debug)]
pub struct LayerRecord {
    index: usize,
    refs: Py<PyList>,
    first: Py<PyList>,
    hold: Py<PyList>,
}

#[pymethods]
impl LayerRecord {
    #[new]
    fn new(index: usize, refs: Py<PyList>, first: Py<PyList>, hold: Py<PyList>) -> Self {
        Self {
            index,
            refs,
            first,
            hold,
        }
    }

    fn __call__(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        args: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let refs = self.refs.bind(py);
        let first: i64 = self.first.bind(py).get_item(0)?.extract()?;
        if usize::try_from(first).ok() == Some(self.index) {
            refs.del_slice(0, refs.len())?;
        }
        let hold = self.hold.bind(py).get_item(0)?;
        if let Ok(keep) = hold.cast::<PyBool>() {
            let out = if keep.is_true() {
                output.clone()
            } else {
                py.None().into_bound(py)
            };
            return refs.append((self.index, out, args));
        }
        refs.append((self.index, py.None(), py.None()))?;
        if let Ok(maxima) = hold.cast::<OutputMaxima>() {
            if let Ok(mut m) = maxima.try_borrow_mut() {
                return m.__call__(py, self.index, output);
            }
        }
        if !hold.is_none() {
            hold.call1((self.index, output, args))?;
        }
        Ok(())
    }
}

/// An activation probe's record (`_hooks.make_slot_record`): `slots[row] = output`.
#[pyclass(module = "neuraldbg._native", name = "SlotRecord", frozen)]
#[derive(Debug)]
pub struct SlotRecord {
    row: usize,
    slots: Py<PyList>,
}

#[pymethods]
impl SlotRecord {
    #[new]
    fn new(row: usize, slots: Py<PyList>) -> Self {
        Self { row, slots }
    }

    fn __call__(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        _args: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.slots.bind(py).set_item(self.row, output)
    }
}
